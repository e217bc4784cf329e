"""The on-device bitmask application agrees with xgrammar's own CPU kernel on random masks, with
rows without a grammar, row subsets and vocabulary padding either way; and it never needs the
logits' values on the host (it runs on torch's `meta` device, which has no values at all)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from beam_hpu.runtime.grammar.hpu_device_mask import apply_token_bitmask  # noqa: E402


def random_bitmask(rows: int, words: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    packed = rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    # Real grammars allow few tokens: make some rows sparse, one allow a single token, and one
    # have no grammar at all (vLLM fills those rows with -1).
    packed[0] = -1
    if rows > 1:
        packed[1] = 0
        packed[1, words // 2] = np.int32(-(2**31))  # only the top bit of one word
    if rows > 2:
        packed[2] &= rng.integers(-(2**31), 2**31, size=words, dtype=np.int64).astype(np.int32)
    return torch.from_numpy(packed)


def xgrammar_reference(logits, bitmask, **kwargs):
    expected = logits.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # xgrammar warns when the bitmask is narrower than the logits
        xgr.apply_token_bitmask_inplace(expected, bitmask, backend="cpu", **kwargs)
    return expected


CASES = [
    # (rows, logits width, bitmask words, kwargs)
    pytest.param(4, 32 * 40, 40, {}, id="exact-width"),
    pytest.param(5, 1000, 32, {}, id="bitmask-wider-than-logits"),
    pytest.param(5, 1000, 30, {}, id="logits-wider-than-bitmask"),
    pytest.param(6, 1000, 32, dict(vocab_size=997), id="vocab-size-given"),
    pytest.param(6, 1024, 32, dict(vocab_size=990), id="padded-logits-and-bitmask"),
    pytest.param(6, 777, 25, dict(indices=[1, 4, 5]), id="indices-list"),
    pytest.param(6, 777, 25, dict(indices=torch.tensor([0, 2])), id="indices-tensor"),
    pytest.param(3, 151936, 4748, {}, id="beam-vocab"),
]


@pytest.mark.parametrize("rows, width, words, kwargs", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_xgrammar_cpu_kernel(rows, width, words, kwargs, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, generator=generator)
    bitmask = random_bitmask(rows, words, seed)
    expected = xgrammar_reference(logits, bitmask, **kwargs)
    mine = logits.clone()
    apply_token_bitmask(mine, bitmask, **kwargs)
    assert torch.equal(mine, expected)
    # The check bites: something was masked, and the no-grammar row was left alone.
    assert torch.isinf(mine).any()
    assert torch.equal(mine[0], logits[0])


def test_bitmask_with_fewer_rows_than_logits_under_indices():
    logits = torch.randn(8, 320)
    bitmask = random_bitmask(4, 10, seed=3)
    expected = xgrammar_reference(logits, bitmask, indices=[1, 3])
    mine = logits.clone()
    apply_token_bitmask(mine, bitmask, indices=[1, 3])
    assert torch.equal(mine, expected)
    assert torch.equal(mine[4:], logits[4:])


def test_numpy_bitmask_and_bf16_logits():
    # vLLM hands the bitmask over as a numpy array; HPU logits are bf16 (xgrammar's CPU kernel
    # takes float32, so compare on the float32 copy).
    logits = torch.randn(4, 640).to(torch.bfloat16)
    bitmask = random_bitmask(4, 20, seed=4)
    expected = xgrammar_reference(logits.float(), bitmask)
    mine = logits.clone()
    apply_token_bitmask(mine, bitmask.numpy())
    assert mine.dtype == torch.bfloat16
    assert torch.equal(mine.float(), expected)


def test_no_host_round_trip_of_the_logits():
    # A meta tensor has a shape and a device but no values: any .cpu(), .item(), .tolist() or
    # host-side indexing by its values would raise. The bitmask may come from the host.
    logits = torch.empty(6, 1000, device="meta")
    apply_token_bitmask(logits, random_bitmask(6, 32, seed=5))
    apply_token_bitmask(logits, random_bitmask(6, 32, seed=5), indices=torch.tensor([1, 2], device="meta"))
    assert logits.device.type == "meta"


@pytest.mark.parametrize(
    "logits_shape, bitmask, kwargs, message",
    [
        ((4, 64), torch.zeros(4, 2, dtype=torch.int64), {}, "int32"),
        ((4, 64), torch.zeros(3, 2, dtype=torch.int32), {}, "pass indices"),
        ((4, 64), torch.zeros(4, 2, dtype=torch.int32), dict(vocab_size=65), "vocab_size 65"),
        ((64,), torch.zeros(1, 2, dtype=torch.int32), {}, "rows, vocab"),
    ],
)
def test_bad_shapes_are_refused(logits_shape, bitmask, kwargs, message):
    with pytest.raises(ValueError, match=message):
        apply_token_bitmask(torch.zeros(logits_shape), bitmask, **kwargs)


def test_device_mask_switch_reads_the_port_switch():
    from beam_hpu.settings.switches import SwitchError
    from beam_hpu.runtime.grammar.hpu_device_mask import device_mask_enabled

    assert device_mask_enabled({}) is True  # the recipe's value is the default
    assert device_mask_enabled({"BEAM_GRAMMAR_DEVICE_MASK": "0"}) is False
    with pytest.raises(SwitchError, match="BEAM_GRAMMAR_DEVICE_MASK"):
        device_mask_enabled({"BEAM_GRAMMAR_DEVICE_MASK": "yes"})
