"""The names the port shares with vLLM, transformers and the checkpoint, each written once.

Beam is called `beam` in four registries that do not know of each other: transformers'
`model_type`, vLLM's `--load-format`, and vLLM's reasoning and tool parser registries. They are
the same word by convention only, so each gets its own name here: code says which one it means.
"""

# transformers' config.json `model_type` (BeamConfig) and the architecture vLLM builds.
MODEL_TYPE = "beam"
ARCH = "BeamForCausalLM"
MODEL_CLASS = "beam_hpu.model.beam:BeamForCausalLM"  # imported lazily by vLLM's registry
# Beam's DFlash2 drafter: the architecture its config.json names (upstream vLLM 0.34 registers the
# same name) and the class built for it.
DRAFT_ARCH = "DFlash2BeamDraftModel"
DRAFT_MODEL_CLASS = "beam_hpu.model.dflash2:DFlash2BeamForCausalLM"

# vLLM `--load-format` (beam_hpu.loader) and `--reasoning-parser` / `--tool-call-parser`.
LOAD_FORMAT = "beam"
PARSER = "beam"

# vLLM only gives handlers to loggers under its own namespace: ours would print nothing otherwise.
LOGGER = "vllm.beam_hpu"
