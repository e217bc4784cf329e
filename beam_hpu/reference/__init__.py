"""The per-token FP8 reference: what Beam's outputs should be, computed on CPU from the checkpoint,
and the file the perplexity gate reads.

- `in_memory`: transformers' Beam with the checkpoint's FP8 weights and per-token FP8 activation
  rounding (the served path's definition, `beam_hpu.quant.rounding`), the whole model in memory;
- `live`: the reference document of a model a host can hold (the live perplexity gate);
- `streamed`: the same document for the 501B model, one layer at a time (`beam-hpu reference`),
  over `plan` (everything checked before a weight is read), `layer_stream` (a layer's tensors read
  and run) and `workdir` (per-layer hidden states, for resuming);
- `file_format`: the file's one definition (`beam-gates-reference/1`).
Work that streams the checkpoint the same way (the FP8 KV-cache calibration) belongs here too.

Arrows run down: gates -> reference -> quant -> loader -> model. Nothing here imports
`beam_hpu.gates`, `beam_hpu.cli` or `beam_hpu.replicas` (tests/test_import_graph.py); a gate profile
reaches these functions as an argument.
"""
