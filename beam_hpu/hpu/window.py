"""Exact sliding windows over a paged KV cache: which blocks a query needs and which slots of them.

A sliding-window layer lets the query at position `i` attend the keys `j` with `i - W < j <= i`
(vLLM and transformers agree). vllm-gaudi's paged decode is block-granular: it hands a sliding
layer the last `W // block_size` blocks of the block table and masks only the unwritten tail of
the last one, so it attends between `W - block_size + 1` and `W` keys, never exactly `W` unless
the query sits at the end of a block. The runner patches for Beam call the functions below instead;
they are plain torch on CPU tensors (the runner builds attention metadata on the host) and are
tested against the definition for every position near block and window edges.

Positions and block indices are 0-based; a sequence's block `b` holds the keys at positions
`b * block_size .. b * block_size + block_size - 1`. A "block index" below is a column of the
sequence's block table, not a physical block id.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def _check_geometry(window: int, block_size: int) -> None:
    if window < 1:
        raise ValueError(f"sliding window must be at least 1 token, got {window}")
    if block_size < 1:
        raise ValueError(f"block size must be at least 1 token, got {block_size}")


def window_block_count(window: int, block_size: int) -> int:
    """The most blocks the `window` keys of one query can touch.

    The keys `i-W+1 .. i` may start at the last slot of a block, so they can straddle
    ceil((W-1) / block_size) + 1 blocks. That is `W // block_size + 1` when `W % block_size` is 0
    or 1 (Beam: 512 and 128 give 5), and one block more for any other remainder.
    """
    _check_geometry(window, block_size)
    return -(-(window - 1) // block_size) + 1


def first_window_key(pos: int, window: int) -> int:
    return max(0, pos - window + 1)


def decode_window_blocks(pos: int, window: int, block_size: int) -> range:
    """Block-table columns a decode query at `pos` needs: a tail of the table, at most
    `window_block_count` long, whose first block holds the oldest key in the window (so no block
    taken is entirely masked)."""
    _check_geometry(window, block_size)
    if pos < 0:
        raise ValueError(f"a decode query's position must be >= 0, got {pos}")
    return range(first_window_key(pos, window) // block_size, pos // block_size + 1)


class DecodeWindow(NamedTuple):
    block_index: torch.Tensor  # [B, n] int64 block-table columns, left-aligned; -1 = unused
    slot_mask: torch.Tensor  # [B, n, block_size] bool; True = the key in that slot is attended


def decode_window(positions: torch.Tensor | list[int], window: int, block_size: int) -> DecodeWindow:
    """Window blocks and per-slot mask for a (padded) decode batch; n = window_block_count.

    `positions[b]` is the position of sequence b's decode query (its context length); a negative
    position marks a padding row, which gets no blocks and an all-False mask.
    """
    _check_geometry(window, block_size)
    n = window_block_count(window, block_size)
    pos = torch.as_tensor(positions, dtype=torch.int64).reshape(-1, 1)  # [B, 1]
    first_block = (pos - window + 1).clamp(min=0) // block_size  # [B, 1]
    block_index = first_block + torch.arange(n)  # [B, n]
    used = (block_index <= pos // block_size) & (pos >= 0)  # [B, n]
    key_pos = block_index.unsqueeze(-1) * block_size + torch.arange(block_size)  # [B, n, bs]
    query_pos = pos.unsqueeze(-1)  # [B, 1, 1]
    slot_mask = used.unsqueeze(-1) & (key_pos > query_pos - window) & (key_pos <= query_pos)
    return DecodeWindow(torch.where(used, block_index, -1), slot_mask)


def decode_window_slot_mask(pos: int, window: int, block_size: int) -> torch.Tensor:
    """[len(decode_window_blocks(...)), block_size] bool mask for one decode query at `pos`."""
    if pos < 0:
        raise ValueError(f"a decode query's position must be >= 0, got {pos}")
    result = decode_window([pos], window, block_size)
    return result.slot_mask[0][result.block_index[0] >= 0]


def flat_decode_window(
    block_table: torch.Tensor, positions: torch.Tensor | list[int], window: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The window in vllm-gaudi's flat paged-attention layout, before bucket padding.

    `block_table` is [B, max_blocks] physical block ids. Returns `block_list` [N] (physical ids of
    every sequence's window blocks, sequence after sequence), `block_groups` [N] (the batch row
    each belongs to) and `slot_mask` [N, block_size], which replaces vllm-gaudi's usage-only
    window bias.
    """
    result = decode_window(positions, window, block_size)
    used = result.block_index >= 0  # [B, n]
    block_ids = block_table.to(torch.int64).gather(1, result.block_index.clamp(min=0))  # [B, n]
    rows = torch.arange(used.shape[0]).unsqueeze(1).expand_as(used)  # [B, n]
    return block_ids[used], rows[used], result.slot_mask[used]


def prefill_window_context_blocks(ctx_len: int, window: int, block_size: int) -> range:
    """Context blocks a prefill chunk starting at position `ctx_len` can see through the window.

    The chunk's first query (at `ctx_len`) reaches back furthest: to `ctx_len - W + 1`. Context
    blocks before the one holding that key are outside every query's window; the list is at most
    `window_block_count` long whatever the context length.
    """
    _check_geometry(window, block_size)
    first = first_window_key(ctx_len, window)
    if first >= ctx_len:  # no context, or a window of one token
        return range(0)
    return range(first // block_size, (ctx_len - 1) // block_size + 1)


def prefill_window_block_starts(ctx_lens: torch.Tensor | list[int], window: int, block_size: int) -> torch.Tensor:
    """[B] first block-table column of each sequence's window-trimmed context."""
    _check_geometry(window, block_size)
    ctx = torch.as_tensor(ctx_lens, dtype=torch.int64)
    return (ctx - window + 1).clamp(min=0) // block_size


def prefill_window_mask(
    ctx_lens: torch.Tensor | list[int],
    query_lens: torch.Tensor | list[int],
    window: int,
    block_size: int,
    *,
    ctx_block_starts: torch.Tensor | list[int] | None = None,
    num_ctx_blocks: int | None = None,
    padded_query_len: int | None = None,
) -> torch.Tensor:
    """Dense [B, S, num_ctx_blocks * block_size + S] bool mask (True = attend) for prefill chunks.

    Keys are laid out as vllm-gaudi lays them for prefill with context: `num_ctx_blocks` context
    blocks (sequence b's block-table columns from `ctx_block_starts[b]` on; 0 = the full context,
    `prefill_window_block_starts` = the window-trimmed context) followed by the chunk's own S
    keys. Query row i of sequence b sits at position ctx_lens[b] + i. Context slots past the
    context and chunk keys past query_lens[b] are padding and never attended; padding query rows
    attend only their own diagonal key, so no softmax row is empty.
    """
    _check_geometry(window, block_size)
    ctx = torch.as_tensor(ctx_lens, dtype=torch.int64).reshape(-1)  # [B]
    qlen = torch.as_tensor(query_lens, dtype=torch.int64).reshape(-1)  # [B]
    if ctx_block_starts is None:
        ctx_block_starts = torch.zeros_like(ctx)
    starts = torch.as_tensor(ctx_block_starts, dtype=torch.int64).reshape(-1)  # [B]
    if num_ctx_blocks is None:
        num_ctx_blocks = int(((ctx + block_size - 1) // block_size - starts).clamp(min=0).max())
    if padded_query_len is None:
        padded_query_len = int(qlen.max())
    if (ctx < 0).any() or (qlen < 0).any() or (qlen > padded_query_len).any():
        raise ValueError("context lengths must be >= 0 and query lengths within [0, padded_query_len]")
    ctx_slots, rows = num_ctx_blocks * block_size, padded_query_len

    slot = torch.arange(ctx_slots)
    ctx_key_pos = starts[:, None] * block_size + slot  # [B, C*bs]
    ctx_key_real = ctx_key_pos < ctx[:, None]  # [B, C*bs]
    chunk = torch.arange(rows)
    chunk_key_pos = ctx[:, None] + chunk  # [B, S]
    chunk_key_real = chunk < qlen[:, None]  # [B, S]
    key_pos = torch.cat([ctx_key_pos, chunk_key_pos], dim=1).unsqueeze(1)  # [B, 1, K]
    key_real = torch.cat([ctx_key_real, chunk_key_real], dim=1).unsqueeze(1)  # [B, 1, K]

    query_pos = chunk_key_pos.unsqueeze(2)  # [B, S, 1]
    query_real = chunk_key_real.unsqueeze(2)  # [B, S, 1]
    in_window = (key_pos > query_pos - window) & (key_pos <= query_pos)  # [B, S, K]
    mask = query_real & key_real & in_window
    own_key = torch.arange(ctx_slots + rows) == (ctx_slots + chunk)[:, None]  # [S, K]
    return mask | (~query_real & own_key)


def mask_to_bias(mask: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Additive attention bias: 0 where `mask` attends, -inf where it does not."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
