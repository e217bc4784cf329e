"""Tiny checkpoints shared by the FP8 tests: each is written once per session."""

from pathlib import Path

import pytest

from beam_hpu.quant.fp8_checkpoint import load_checkpoint_tensors, quantize_checkpoint, write_tiny_fp8_checkpoint
from beam_hpu.tiny import write_tiny_checkpoint

PRESET, SEED = "small", 0
# The sandwich post-norms scale each residual branch; at the random init's gain of ~1 the tiny
# model is chaotic (an expert flip from a rounding difference moves the logits so much that bf16
# vs fp32 alone gives KL ~0.05 and top-1 ~83%), which would drown the FP8 effects being measured.
# At 0.1 bf16 vs fp32 gives KL ~0.0007, and FP8 effects stand out from rounding noise.
CONDITIONED_POST_NORM_GAIN = 0.1


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(bf16 tiny Beam, its FP8 checkpoint) as `write_tiny_fp8_checkpoint` writes them."""
    root = tmp_path_factory.mktemp("tiny")
    bf16 = write_tiny_checkpoint(root / "bf16", PRESET, seed=SEED)
    return bf16, write_tiny_fp8_checkpoint(root / "fp8", PRESET, seed=SEED)


@pytest.fixture(scope="session")
def conditioned_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(bf16, FP8) of the same tiny Beam with post-norm gains scaled to tame routing chaos."""
    root = tmp_path_factory.mktemp("conditioned")
    bf16 = write_tiny_checkpoint(root / "bf16", PRESET, seed=SEED)
    state = load_checkpoint_tensors(bf16)
    for name, t in state.items():
        if name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
            state[name] = (t.float() * CONDITIONED_POST_NORM_GAIN).to(t.dtype)
    bf16 = write_tiny_checkpoint(root / "bf16", PRESET, seed=SEED, state_dict=state)
    return bf16, quantize_checkpoint(bf16, root / "fp8")

