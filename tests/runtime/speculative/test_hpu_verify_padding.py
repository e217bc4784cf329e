"""A verify step's padding rows (row j >= num_tokens[s] of a real sequence s) write to the pad
block: beam_hpu.runtime.speculative.hpu_verify_tables.verify_step_padding_slots on vllm-gaudi's [batch, tokens] slot
mapping, where such a row holds the slot of the sequence's position 0."""

import itertools

import pytest
import torch

from beam_hpu.runtime.speculative.hpu_verify_tables import verify_step_padding_slots

BS = 4
PAD_BASE = 50 * BS  # the pad block of a 50-block pool


def stock_slot_mapping(tables, context_lens, num_tokens, padded_batch, width):
    """vllm-gaudi's layout: real rows at their own slot, padding rows at position 0's slot, padded
    sequences from the pad block's cycle (consumed first, as the runner does)."""
    cycle = itertools.cycle(range(PAD_BASE, PAD_BASE + BS))
    slots = torch.zeros((padded_batch, width), dtype=torch.int64)
    for s in range(padded_batch):
        for j in range(width):
            if s >= len(context_lens):
                slots[s, j] = next(cycle)
            else:
                p = context_lens[s] + j if j < num_tokens[s] else 0
                slots[s, j] = tables[s][p // BS] * BS + p % BS
    return slots, cycle


def test_padding_rows_take_the_next_pad_slots_and_real_rows_keep_theirs():
    tables = [[10, 11, 12, 13], [20, 21, 22], [30, 31, 32]]
    context_lens, num_tokens = [9, 6, 3], [3, 1, 2]
    slots, cycle = stock_slot_mapping(tables, context_lens, num_tokens + [0], 4, 3)
    out = verify_step_padding_slots(slots, num_tokens + [0], 3, cycle)
    # sequence 3 (padded) took pad slots 0..2 of the cycle; the three padding rows get 3, 0, 1
    assert out.tolist() == [
        [12 * BS + 1, 12 * BS + 2, 12 * BS + 3],
        [21 * BS + 2, PAD_BASE + 3, PAD_BASE + 0],
        [30 * BS + 3, 31 * BS + 0, PAD_BASE + 1],
        [PAD_BASE + 0, PAD_BASE + 1, PAD_BASE + 2],
    ]
    assert slots[1, 1] == 20 * BS  # the input is left as it was (position 0's slot, stock)


def test_no_padding_rows_leave_the_mapping_and_the_cycle_alone():
    slots = torch.arange(10).reshape(2, 5)
    cycle = iter(range(100, 104))
    assert torch.equal(verify_step_padding_slots(slots, [5, 5], 2, cycle), slots)
    assert next(cycle) == 100


@pytest.mark.parametrize("shape,counts,decodes,match", [
    ((6, ), [3, 3], 2, "must be \\[batch, tokens\\]"),
    ((2, 3), [3], 2, "2 decodes for a slot mapping of 2 sequences and 1 token counts"),
    ((2, 3), [3, 4], 2, "sequence 1 schedules 4 tokens, the step has rows for 1..3"),
    ((2, 3), [0, 3], 2, "sequence 0 schedules 0 tokens"),
])
def test_inconsistent_steps_are_refused(shape, counts, decodes, match):
    with pytest.raises(ValueError, match=match):
        verify_step_padding_slots(torch.zeros(shape, dtype=torch.int64), counts, decodes, itertools.repeat(0))
