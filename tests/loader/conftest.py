"""Tiny checkpoints for the loader tests, written once per session."""

import pytest

from beam_hpu.tiny.fp8_checkpoint import write_tiny_fp8_checkpoint


@pytest.fixture(scope="session")
def tiny_fp8(tmp_path_factory):
    """The default tiny Beam quantised as the published checkpoint is (FP8 weights, fp32 scales)."""
    return write_tiny_fp8_checkpoint(tmp_path_factory.mktemp("tiny-small-fp8"), "small", seed=0)
