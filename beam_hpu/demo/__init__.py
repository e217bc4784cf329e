"""The tiny Beam served on CPU: `serve.py` holds the `vllm serve` command line (flag for flag from
the Gaudi recipe where it applies), its environment and the checkpoint it serves, for the single
demo and for each replica of `beam_hpu.replicas`."""
