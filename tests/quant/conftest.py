"""Tiny checkpoints shared by the FP8 tests: each is written once per session."""

from pathlib import Path

import pytest

from beam_hpu.quant.fp8_checkpoint import quantize_checkpoint, write_tiny_fp8_checkpoint
from beam_hpu.tiny import CONDITIONED_POST_NORM_GAIN, write_tiny_checkpoint

PRESET, SEED = "small", 0


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(bf16 tiny Beam, its FP8 checkpoint) as `write_tiny_fp8_checkpoint` writes them."""
    root = tmp_path_factory.mktemp("tiny")
    bf16 = write_tiny_checkpoint(root / "bf16", PRESET, seed=SEED)
    return bf16, write_tiny_fp8_checkpoint(root / "fp8", PRESET, seed=SEED)


@pytest.fixture(scope="session")
def conditioned_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(bf16, FP8) of the same tiny Beam with post-norm gains scaled to tame routing chaos
    (`beam_hpu.tiny.CONDITIONED_POST_NORM_GAIN` says why): the model the accuracy tests measure."""
    root = tmp_path_factory.mktemp("conditioned")
    bf16 = write_tiny_checkpoint(root / "bf16", PRESET, seed=SEED, post_norm_gain=CONDITIONED_POST_NORM_GAIN)
    return bf16, quantize_checkpoint(bf16, root / "fp8")
