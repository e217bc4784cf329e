"""Block counts and slots for vllm-gaudi's EAGLE draft steps at the end of a sequence.

After its first pass (which runs on the verify step's own decode metadata) vllm-gaudi's
HpuEagleProposer drafts k - 1 more tokens one step at a time, each at the next position of every
sequence (`HpuEagleProposer.prepare_attn_metadata`). For a sequence whose last accepted token is
at position p those steps are at p + 1 .. p + k - 1, and near the end of the model length they run
past it: a request that ends at max_model_len had its last verified token at max_model_len - 2, so
from k = 3 on its draft steps reach max_model_len. The drafts of such a step are dropped (the
request has no room for them), but their metadata is still built and their K/V still written:

- vllm-gaudi clamps such a position to 0 for the slot, so the step writes its drafter K/V over
  the sequence's position 0 (with prefix caching a block other requests share), where vLLM's
  GPU proposer writes it nowhere (PADDING_SLOT_ID) and attends one key;
- it counts the row's blocks from the unclamped position, ceil((p + 1) / block_size), one more than
  the block table holds (cdiv(max_model_len, block_size) columns) when max_model_len is a multiple
  of the block size (the recipe's 262144 with blocks of 128): its `assert len(seq_block_table) == n`
  then stops the engine.

`draft_step_block_counts` counts the blocks of the clamped position (an ended row attends the
sequence's first block, like vLLM's seq_len of 1), and `draft_step_pad_slots` sends an ended row's
K/V to the runner's pad block.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def draft_step_block_counts(positions: torch.Tensor, max_model_len: int, block_size: int) -> torch.Tensor:
    """Blocks each draft-step row attends: through the block of its position, or 1 for a row at
    or past max_model_len (position clamped to 0, as vllm-gaudi clamps it for the slot)."""
    if block_size < 1:
        raise ValueError(f"draft step: block size must be at least 1 token, got {block_size}")
    positions = positions.reshape(-1).to(torch.int64)
    clamped = torch.where(positions >= max_model_len, torch.zeros_like(positions), positions)
    return (clamped // block_size + 1).to(torch.int32)


def draft_step_pad_slots(slot_mapping: torch.Tensor, positions: torch.Tensor, num_seq: int, max_model_len: int,
                         pad_slots: Iterator[int]) -> torch.Tensor:
    """slot_mapping ([batch, 1]) with the rows of real sequences (i < num_seq) at or past
    max_model_len pointed at the next slot of `pad_slots` (the runner's cycle over its pad block);
    every other row unchanged."""
    if slot_mapping.dim() != 2 or slot_mapping.shape[1] != 1:
        raise ValueError(f"draft step: slot mapping must be [batch, 1], got shape {tuple(slot_mapping.shape)}")
    positions = positions.reshape(-1)
    if positions.numel() != slot_mapping.shape[0] or not 0 <= num_seq <= positions.numel():
        raise ValueError(f"draft step: {positions.numel()} positions and {num_seq} sequences for a slot mapping "
                         f"of {slot_mapping.shape[0]} rows")
    out = slot_mapping.clone()
    for i in range(num_seq):
        if int(positions[i]) >= max_model_len:
            out[i, 0] = next(pad_slots)
    return out
