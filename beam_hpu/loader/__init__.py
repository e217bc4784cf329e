"""`--load-format beam`: plan reads from safetensors headers, read only this rank's bytes in
parallel, place them, check the model is loaded exactly once.

Rooms: checkpoint (headers, index, checks) -> probe (what the model's loaders take from each
tensor) -> plan (all tensors, completeness) -> place + reader (bytes into parameters) -> load
(the whole flow) -> vllm_loader (the BaseModelLoader vLLM calls).
"""

from __future__ import annotations

from beam_hpu.names import LOAD_FORMAT

_registered = False


def register() -> None:
    """Register the loader with vLLM under `--load-format beam` (idempotent, imports lazily)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader

    from beam_hpu.loader.vllm_loader import BeamModelLoader

    register_model_loader(LOAD_FORMAT)(BeamModelLoader)
    _registered = True
