"""The tiny Beam quantised to FP8 as the published checkpoint is: the writer beside the tiny
Beam's own, using the project's quantiser (beam_hpu.quant.fp8_checkpoint)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from beam_hpu.quant.fp8_checkpoint import quantize_checkpoint
from beam_hpu.tiny.checkpoint import write_tiny_checkpoint


def write_tiny_fp8_checkpoint(
    out: str | Path,
    preset_name: str = "small",
    seed: int = 0,
    *,
    source_dtype: str = "bfloat16",
    num_shards: int = 3,
    ignore: list[str] | None = None,
    **overrides,
) -> Path:
    """The tiny Beam of `beam_hpu.tiny.checkpoint` (same preset, seed, tokenizer), quantised to FP8.

    `write_tiny_checkpoint(dir, preset_name, dtype=source_dtype, seed=seed)` gives the unquantised
    model this checkpoint was made from: the bf16 oracle for accuracy checks.
    """
    with tempfile.TemporaryDirectory(prefix="beam-tiny-src-") as src:
        write_tiny_checkpoint(src, preset_name, dtype=source_dtype, seed=seed, num_shards=num_shards, **overrides)
        return quantize_checkpoint(src, out, ignore)
