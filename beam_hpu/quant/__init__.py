"""FP8 for Beam: the published checkpoint format (compressed-tensors, per-channel FP8 weights,
dynamic per-token FP8 activations) and its quantiser (the tiny FP8 Beam is written by
beam_hpu.tiny.fp8_checkpoint), and accuracy metrics.

On HPU vllm-gaudi's compressed-tensors methods serve the checkpoint; nothing here replaces them.
"""
