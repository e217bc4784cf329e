"""FP8 (e4m3fn) per-channel weights back to floats, bit for bit as compressed-tensors' dequantiser
computes them (`weight.to(scale.dtype) * scale`, then the target dtype), in fewer passes.

Why: the layer-streaming reference dequantises 256 experts x 3 matrices per MoE layer, and
compressed-tensors' path (a new tensor for the conversion, another for the product, a third to
fuse gate and up with torch.cat) was 3/4 of an MoE layer's time in a profile. Here torch's own
conversion writes straight into the fused output and torch's own product runs there in place:
the same operands through the same kernels, so the bits agree (`tests/quant/test_fp8_dequant.py`
holds it to compressed-tensors on every code and Beam's shapes), with two of the five passes over
the weights gone (`benchmarks/fp8_dequant.py` measures both).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn


def dequantise_rows(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """torch.cat([w.to(s.dtype) * s for w, s in parts]).to(dtype): per-channel FP8 weights `w`
    [O_k, I] with scales `s` [O_k, 1], stacked along the output channels (gate and up of an expert
    into transformers' fused gate_up)."""
    scale_dtype = parts[0][1].dtype
    if any(s.dtype != scale_dtype or w.dtype != FP8 or tuple(s.shape) != (w.shape[0], 1) for w, s in parts):
        raise ValueError("dequantise_rows: FP8 weights with [out, 1] scales of one dtype expected, got "
                         + ", ".join(f"{list(w.shape)} {w.dtype} / {list(s.shape)} {s.dtype}" for w, s in parts))
    out = torch.empty((sum(w.shape[0] for w, _ in parts), parts[0][0].shape[1]), dtype=scale_dtype)  # [O, I]
    row = 0
    for w, s in parts:
        block = out[row: row + w.shape[0]]
        block.copy_(w)  # the conversion .to(scale dtype) makes, into place
        block.mul_(s)
        row += w.shape[0]
    return out.to(dtype)
