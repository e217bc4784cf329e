"""EAGLE draft-step rows at the end of the model length (beam_hpu.runtime.speculative.hpu_draft_step), against the
definition: a row below max_model_len keeps its own position's block count and slot; a row at
or past it attends one block and writes to the pad block; the block count always fits a table
of cdiv(max_model_len, block_size) columns."""

import itertools

import pytest
import torch

from beam_hpu.runtime.speculative.hpu_draft_step import draft_step_block_counts, draft_step_pad_slots


@pytest.mark.parametrize("bs", [1, 4, 128])
@pytest.mark.parametrize("max_model_len", [8 * 128, 8 * 128 + 1, 8 * 128 - 1])
def test_block_counts_match_the_definition_and_fit_the_table(bs, max_model_len):
    width = -(-max_model_len // bs)
    positions = torch.tensor(list(range(max_model_len - 3 * bs, max_model_len + 4)) + [0, 1], dtype=torch.int64)
    counts = draft_step_block_counts(positions, max_model_len, bs).tolist()
    for p, n in zip(positions.tolist(), counts):
        assert n == (p // bs + 1 if p < max_model_len else 1), (p, n)
        assert 1 <= n <= width


def test_pad_slots_only_for_real_rows_past_max_model_len():
    max_model_len, pad_base, bs = 64, 1000, 4
    positions = torch.tensor([63, 64, 70, 5, 99])  # rows 3 and 4 are the proposer's padded rows
    slots = torch.tensor([[7], [8], [9], [10], [1000]], dtype=torch.int64)
    cycle = itertools.cycle(range(pad_base + 1, pad_base + bs))
    out = draft_step_pad_slots(slots, positions, 4, max_model_len, cycle)
    assert out.reshape(-1).tolist() == [7, 1001, 1002, 10, 1000]
    assert slots.reshape(-1).tolist() == [7, 8, 9, 10, 1000]  # the input is left alone
    assert out.dtype == slots.dtype


def test_bad_shapes_name_the_draft_step():
    with pytest.raises(ValueError, match="draft step: slot mapping must be"):
        draft_step_pad_slots(torch.zeros(3, dtype=torch.int64), torch.zeros(3), 3, 8, iter(range(9)))
    with pytest.raises(ValueError, match="draft step: 2 positions and 3 sequences"):
        draft_step_pad_slots(torch.zeros(3, 1, dtype=torch.int64), torch.zeros(2), 3, 8, iter(range(9)))
    with pytest.raises(ValueError, match="block size"):
        draft_step_block_counts(torch.zeros(2), 8, 0)
