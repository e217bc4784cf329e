"""FP8 (e4m3fn) per-channel weights back to floats, bit for bit as compressed-tensors' dequantiser
computes them (`weight.to(scale.dtype) * scale`, then the target dtype), faster.

Why: the layer-streaming reference dequantises 256 experts x 3 matrices per MoE layer, and with
compressed-tensors' path (torch's fp8 -> float conversion, then the product, then a copy to fuse
gate and up) that was most of an MoE layer's time (`benchmarks/reference_stream.py`). Here the
conversion is a table lookup over byte pairs (two FP8 codes per 16-bit index, so the index
tensor is half as long), written straight into the fused output, and the product is torch's own
in place: the same operands through the same multiply, so the bits agree
(`tests/quant/test_fp8_dequant.py` holds it to compressed-tensors on every code and real shapes).
"""

from __future__ import annotations

import sys
from functools import cache

import torch

FP8 = torch.float8_e4m3fn
# Byte pairs looked up per step: the int32 index chunk (4 MiB) stays in cache.
CHUNK_PAIRS = 1 << 20


@cache
def _pair_table(dtype: torch.dtype) -> torch.Tensor:
    """[65536, 2]: for each 16-bit little-endian pair of FP8 codes, their two values in `dtype`."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8).to(dtype)  # [256]
    codes = torch.arange(1 << 16, dtype=torch.int32)
    return torch.stack([values[codes & 0xFF], values[codes >> 8]], dim=-1).contiguous()


def _convert_into(out: torch.Tensor, weight: torch.Tensor) -> None:
    """out[...] = weight.to(out.dtype), for contiguous 2-D `weight` (FP8) and `out`."""
    if sys.byteorder != "little" or weight.shape[-1] % 2 or not weight.is_contiguous():
        out.copy_(weight.to(out.dtype))
        return
    table = _pair_table(out.dtype)
    pairs = weight.view(torch.int16).reshape(-1)  # [O*I/2]
    dest = out.view(-1, 2)  # [O*I/2, 2]
    for start in range(0, len(pairs), CHUNK_PAIRS):
        stop = min(len(pairs), start + CHUNK_PAIRS)
        index = pairs[start:stop].to(torch.int32).bitwise_and_(0xFFFF)
        torch.index_select(table, 0, index, out=dest[start:stop])


def dequantise_rows(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """torch.cat([w.to(s.dtype) * s for w, s in parts]).to(dtype): per-channel FP8 weights `w`
    [O_k, I] with scales `s` [O_k, 1], stacked along the output channels (gate and up of an expert
    into transformers' fused gate_up)."""
    scale_dtype = parts[0][1].dtype
    if any(s.dtype != scale_dtype or w.dtype != FP8 or s.shape != (w.shape[0], 1) for w, s in parts):
        raise ValueError("dequantise_rows: FP8 weights with [out, 1] scales of one dtype expected, got "
                         + ", ".join(f"{list(w.shape)} {w.dtype} / {list(s.shape)} {s.dtype}" for w, s in parts))
    cols = parts[0][0].shape[1]
    out = torch.empty((sum(w.shape[0] for w, _ in parts), cols), dtype=scale_dtype)
    row = 0
    for w, s in parts:
        block = out[row: row + w.shape[0]]
        _convert_into(block, w)
        block.mul_(s)
        row += w.shape[0]
    return out.to(dtype)
