"""Dynamic per-token FP8 activation quantisation in its two roundings (switch BEAM_EXACT_ROUNDING).

One function serves the portable CPU FP8 experts (beam_hpu.runtime.fp8.portable_moe, in the mode the
switch names) and the per-token FP8 reference (beam_hpu.reference.in_memory, `exact=`), so that a
served model and its reference can be compared in the same rounding.

exact=True, the reference's rounding: scale = amax / fp8_max in fp32 (an all-zero row gets a tiny
  positive amax instead of 0/0), then x / scale, rounded to the nearest e4m3 value, ties to even.
exact=False, the Gaudi mode: vllm-gaudi's fast path (`extension/ops.py::dynamic_quant`, what the
  recipe runs): scale = (amax + 1e-8) / fp8_max, computed by torch in the activation's own dtype
  (bf16 on the recipe: amax + 1e-8 and the division round to bf16), then
  `cast_to_fp8_v2(x, 1.0 / scale)` as Habana documents it (`gaudi_cast_to_fp8`).

How `cast_to_fp8_v2` rounds is taken from Habana's own card test of it
(HabanaAI/gaudi-pytorch-bridge, tests/pytest_working/compile/test_hpu_fp8_ops.py,
test_cast_to_fp8_v2): its expected output is the FP8 rounding of `input * scale.to(input.dtype)`,
the product rounded to the input's dtype first (bf16 for the recipe's activations), and the test
asserts the card's output equal to it. `fp32_product_cast_to_fp8` is the other candidate (the
product in fp32, one rounding); on bf16 activations of Beam's width the two differ on a few per
cent of elements, by one FP8 step. Both are our model of the kernel; `beam-hpu card-check` asks
the card which it matches. For fp32 activations (the CPU tests serve fp32) the two are one.

Where the two modes differ: (a) x * (1 / s) rounded to x's dtype and x / s in fp32 are different
numbers now and then, one step of e4m3 apart when a rounding boundary falls between them; (b) in a row whose amax is
not large against 1e-8 the fast scale is larger, so the row uses less of the FP8 range; (c) with
bf16 activations the fast scale is a bf16 number. Elsewhere they agree element for element.
`fp8_max` is 448 for OCP e4m3fn (CPU, CUDA) and 240 on Gaudi 2 (vllm-gaudi's FP8_MAX there).
Written here rather than taken from compressed-tensors or vLLM because the range must be a
parameter (240 on Gaudi 2), the library's per-token path reduces 2-D inputs per tensor, and
vLLM's QuantFP8 has a third rounding (x * (1 / scale), no 1e-8, scale floored at 1/(448*512)).
"""

from __future__ import annotations

import torch

FP8_E4M3FN_MAX = 448.0  # OCP e4m3fn: CPU and CUDA
GAUDI2_FP8_MAX = 240.0  # Gaudi 2's e4m3 range
# vllm-gaudi's dynamic_quant adds this to every row's amax before dividing by FP8_MAX.
FAST_PATH_AMAX_EPSILON = 1e-8
# The reference's amax for an all-zero row: any positive scale rounds the row to zeros.
EXACT_ZERO_ROW_AMAX = 1e-12


def per_token_fp8(x: torch.Tensor, fp8_max: float, exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `x` (last dim) to FP8 e4m3 with its own scale: (e4m3fn values, fp32 scale [..., 1]).

    `q.float() * scale` approximates `x`; see the module doc for `exact`.
    """
    if exact:
        xf = x.float()
        scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(EXACT_ZERO_ROW_AMAX) / fp8_max
        scaled = xf / scale
    else:
        # Same op order and dtype as dynamic_quant: the scale's roundings are part of the path.
        scale = (x.abs().amax(dim=-1, keepdim=True) + FAST_PATH_AMAX_EPSILON) / fp8_max
        return gaudi_cast_to_fp8(x, 1.0 / scale, fp8_max), scale.float()
    return scaled.clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn), scale


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # The card computes float64 as fp32 (the bridge's getInternalDtype).
    return torch.float32 if dtype == torch.float64 else dtype


def gaudi_cast_to_fp8(x: torch.Tensor, inv_scale, fp8_max: float) -> torch.Tensor:
    """`cast_to_fp8_v2(x, inv_scale)` as Habana's card test defines it (module doc): the product
    x * inv_scale rounded to x's dtype, then to e4m3 (nearest even), saturated at +-fp8_max."""
    dtype = _compute_dtype(x.dtype)
    inv = torch.as_tensor(inv_scale, device=x.device).to(dtype)
    product = x.to(dtype) * inv
    return product.float().clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)


def fp32_product_cast_to_fp8(x: torch.Tensor, inv_scale, fp8_max: float) -> torch.Tensor:
    """The other model of the same cast: the product in fp32, rounded once to e4m3 (nearest even),
    saturated at +-fp8_max. What `beam-hpu card-check` tells apart from `gaudi_cast_to_fp8`."""
    inv = torch.as_tensor(inv_scale, device=x.device).float()
    return (x.float() * inv).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)


def fake_quant_per_token(x: torch.Tensor, fp8_max: float = FP8_E4M3FN_MAX, exact: bool = True) -> torch.Tensor:
    """`x` rounded per token to FP8 as `per_token_fp8` does, returned as fp32 values."""
    q, scale = per_token_fp8(x, fp8_max, exact)
    return q.float() * scale


# ---------------------------------------------------------------- FP8 KV cache: static per-layer scales
#
# An FP8 KV cache stores each key (value) element as e4m3(x / step) with one step per attention
# layer, and attention reads step * e4m3. The checkpoint carries the step in compressed-tensors'
# form, `k_scale` / `v_scale` = amax / 448 (OCP e4m3fn), and the two servers read it so:
# - vLLM (CPU, CUDA): the step is the file's scale as it is; range +-448;
# - vllm-gaudi (`HPUCompressedTensorsKVCacheMethod`, VLLM_SCALE_ADJUSTMENT on, its default):
#   amax = scale * 448, and the cache casts x * (240 / amax) to Gaudi 2's e4m3 (range +-240),
#   i.e. a step of scale * 448 / 240.
# With no scales in the checkpoint both use a scale of 1.0 (vLLM: `k_scale` 1.0; vllm-gaudi:
# amax 448). One function below rounds for the reference and models both servers' caches.
KV_SCALE_FP8_MAX = FP8_E4M3FN_MAX  # the range compressed-tensors' k_scale / v_scale refer to
DEFAULT_KV_SCALE = 1.0  # what both servers use when the checkpoint has no scales


def kv_cache_scale(amax: float) -> float:
    """The checkpoint's k_scale / v_scale (compressed-tensors form) for an observed |x| maximum.
    An all-zero observation gets the smallest positive scale rather than 0 (0 / 0 on read)."""
    return max(float(amax), EXACT_ZERO_ROW_AMAX) / KV_SCALE_FP8_MAX


def kv_device_step(scale: float, fp8_max: float) -> float:
    """The step a cache of range `fp8_max` rounds with, given the checkpoint's `scale`: the scale
    itself at 448 (vLLM), scale * 448 / 240 on Gaudi 2 (vllm-gaudi's rescaling, module note)."""
    return float(scale) * KV_SCALE_FP8_MAX / fp8_max


def fp8_kv_round(x: torch.Tensor, scale: float, fp8_max: float, exact: bool = True) -> torch.Tensor:
    """`x` as an FP8 KV cache of range `fp8_max` holds and returns it, for the checkpoint's `scale`
    (compressed-tensors form): e4m3(x / step) * step in fp32, saturated at +-fp8_max, step =
    `kv_device_step(scale, fp8_max)`. exact=False is vllm-gaudi's cast_to_fp8_v2(x, 1 / step) in the
    Gaudi mode (`gaudi_cast_to_fp8`: the product in x's dtype)."""
    step = torch.tensor(kv_device_step(scale, fp8_max), dtype=torch.float32)
    if not exact:
        return gaudi_cast_to_fp8(x, 1.0 / step, fp8_max).float() * step
    scaled = x.float() / step
    return scaled.clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn).float() * step
