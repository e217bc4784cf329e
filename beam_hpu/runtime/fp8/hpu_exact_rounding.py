"""BEAM_EXACT_ROUNDING on Gaudi: the per-token FP8 activation quantiser a Beam layer uses.

vllm-gaudi quantises the activations of a compressed-tensors W8A8 FP8 layer with dynamic
per-token scales in `extension/ops.py::dynamic_quant` (the rounding that BEAM_EXACT_ROUNDING=0
names, beam_hpu.quant.rounding): in `apply_fp8_linear_hpu` before every dense FP8 GEMM, and in
`VllmMixtureOfExpertsOpFP8PerChannel.forward` before the fused expert op. The port unit
beam-exact-rounding asks `activation_quantiser` once per layer when its weights are processed
(the worker loads the model inside vLLM's current-config context, so `served_model_type` sees
the served model there) and keeps the answer on the layer: None leaves vllm-gaudi's
`dynamic_quant` in place; otherwise the layer quantises with `per_token_fp8(..., exact=True)`, the
reference's rounding, in the range the tree's FP8_MAX gives (240 on Gaudi 2, 448 on Gaudi 3).

Not reached: the fused MoE op (torch.ops.hpu.mixture_of_experts) quantises the SwiGLU output
before the down projection inside its kernel, so with 1 the experts' second GEMM keeps the
kernel's rounding on Gaudi.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch

from beam_hpu.names import MODEL_TYPE
from beam_hpu.quant.rounding import FP8_E4M3FN_MAX, GAUDI2_FP8_MAX, per_token_fp8
from beam_hpu.settings import switches

# The FP8 maxima vllm-gaudi's FP8_MAX takes: e4m3fnuz's on Gaudi 2, e4m3fn's elsewhere.
DEVICE_FP8_MAXIMA = (GAUDI2_FP8_MAX, FP8_E4M3FN_MAX)

Quantiser = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def activation_quantiser(model_type: str | None, fp8_max: float,
                         env: Mapping[str, str] | None = None) -> Quantiser | None:
    """x -> (e4m3fn values, fp32 scale [..., 1]) in the reference's rounding for a Beam model with
    BEAM_EXACT_ROUNDING=1; None (keep vllm-gaudi's dynamic_quant) for any other model or with 0.
    With 1 and no model type (no vLLM config current) it refuses rather than guess."""
    if not switches.current("BEAM_EXACT_ROUNDING", env):
        return None
    if model_type is None:
        # Without the served model's type the switch would go unread without a word.
        raise ValueError("BEAM_EXACT_ROUNDING=1: no vLLM config is current where vllm-gaudi processes the "
                         "FP8 weights, so the served model type is unknown (the worker loads the model "
                         "inside set_current_vllm_config)")
    if model_type != MODEL_TYPE:
        return None
    if float(fp8_max) not in DEVICE_FP8_MAXIMA:
        raise ValueError(f"BEAM_EXACT_ROUNDING=1: vllm-gaudi's FP8_MAX is {fp8_max}, expected one of "
                         f"{DEVICE_FP8_MAXIMA} (Gaudi 2's e4m3 range, or e4m3fn's)")
    return functools.partial(per_token_fp8, fp8_max=float(fp8_max), exact=True)


def served_model_type() -> str | None:
    """The model type of the vLLM config current now (None outside a config context)."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    hf_config = getattr(getattr(config, "model_config", None), "hf_config", None)
    return getattr(hf_config, "model_type", None)
