import pytest

from beam_hpu.tiny import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_fp32(tmp_path_factory):
    """The default tiny Beam (6 layers, window 16, 8 experts in 4 groups) in fp32."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-small-fp32"), "small", dtype="float32")


@pytest.fixture(scope="session")
def tiny_bf16(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-small-bf16"), "small", dtype="bfloat16")


@pytest.fixture(scope="session")
def tiny_wide_fp32(tmp_path_factory):
    """A second shape: window 24, 8 query heads per 2 KV heads, 16 experts in 8 groups, top-4."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-wide-fp32"), "wide", dtype="float32", seed=1)
