"""Whether the model vLLM is serving (or building) is Beam: what every Beam-only patch asks.

The plugin is installed into images that may serve other models, so each runtime patch and each
port edit acts only when the model is Beam (transformers `model_type` "beam", beam_hpu.names),
or its index entry says why it must be global (`scope`, beam_hpu/runtime/__init__.py and the fix
units). Three ways to ask, by what the caller holds:
- `is_beam_model_type(model_type)`: a model_type string (vllm-gaudi's runner hands one out).
- `serves_beam(vllm_config)`: an object that keeps its engine's VllmConfig (the scheduler).
- `serves_beam_dflash2(vllm_config)`: a runner choosing its drafter (Beam with Beam's DFlash2).
- `building_beam()`: code that runs while vLLM builds the model's layers (quant methods, linear
  kernels), inside vLLM's `set_current_vllm_config` context; outside it (no config) the answer is
  False, so a layer made by hand gets vLLM's own behaviour.
"""

from __future__ import annotations

from typing import Any

from beam_hpu.names import DRAFT_ARCH, MODEL_TYPE


def model_type_of(vllm_config: Any) -> str | None:
    """The hf_config's model_type of a VllmConfig, or None when it has no model config."""
    model_config = getattr(vllm_config, "model_config", None)
    return getattr(getattr(model_config, "hf_config", None), "model_type", None)


def is_beam_model_type(model_type: str | None) -> bool:
    """Whether a model_type (hf_config's, or vllm-gaudi's runner's `_get_model_type()`) is Beam's."""
    return model_type == MODEL_TYPE


def serves_beam(vllm_config: Any) -> bool:
    return is_beam_model_type(model_type_of(vllm_config))


def serves_beam_dflash2(vllm_config: Any) -> bool:
    """A Beam target with `"method": "dflash"` and a drafter whose architectures name Beam's DFlash2."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or spec.method != "dflash" or not serves_beam(vllm_config):
        return False
    return DRAFT_ARCH in (getattr(spec.draft_model_config, "architectures", None) or [])


def building_beam() -> bool:
    """True while vLLM builds a Beam model (the current VllmConfig's model is Beam)."""
    from vllm.config import get_current_vllm_config_or_none

    return serves_beam(get_current_vllm_config_or_none())
