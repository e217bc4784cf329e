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
    device = ctx.device
    qlen = qlen.to(device)
    if ctx_block_starts is None:
        ctx_block_starts = torch.zeros_like(ctx)
    starts = torch.as_tensor(ctx_block_starts, dtype=torch.int64).reshape(-1).to(device)  # [B]
    if num_ctx_blocks is None:
        num_ctx_blocks = int(((ctx + block_size - 1) // block_size - starts).clamp(min=0).max())
    if padded_query_len is None:
        padded_query_len = int(qlen.max())
    # Checked on host tensors only: on a device the check would read device values on the host.
    if device.type == "cpu" and ((ctx < 0).any() or (qlen < 0).any() or (qlen > padded_query_len).any()):
        raise ValueError("context lengths must be >= 0 and query lengths within [0, padded_query_len]")
    ctx_slots, rows = num_ctx_blocks * block_size, padded_query_len

    slot = torch.arange(ctx_slots, device=device)
    ctx_key_pos = starts[:, None] * block_size + slot  # [B, C*bs]
    ctx_key_real = ctx_key_pos < ctx[:, None]  # [B, C*bs]
    chunk = torch.arange(rows, device=device)
    chunk_key_pos = ctx[:, None] + chunk  # [B, S]
    chunk_key_real = chunk < qlen[:, None]  # [B, S]
    key_pos = torch.cat([ctx_key_pos, chunk_key_pos], dim=1).unsqueeze(1)  # [B, 1, K]
    key_real = torch.cat([ctx_key_real, chunk_key_real], dim=1).unsqueeze(1)  # [B, 1, K]

    query_pos = chunk_key_pos.unsqueeze(2)  # [B, S, 1]
    query_real = chunk_key_real.unsqueeze(2)  # [B, S, 1]
    in_window = (key_pos > query_pos - window) & (key_pos <= query_pos)  # [B, S, K]
    mask = query_real & key_real & in_window
    own_key = torch.arange(ctx_slots + rows, device=device) == (ctx_slots + chunk)[:, None]  # [S, K]
    return mask | (~query_real & own_key)


def mask_to_bias(mask: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Additive attention bias: 0 where `mask` attends, -inf where it does not."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


# ---------------------------------------------------------------- what the runner patches call
# The port's runner patches (beam_hpu/runtime/sliding_window/beam-exact-window.toml) hand over the
# runner's own host-side structures and get them back in the runner's layout; the arithmetic is
# the functions above.


def decode_window_tables(
    block_tables: list[list[int]], slot_mapping: list[list[int]], window: int, block_size: int
) -> tuple[list[list[int]], list[int]]:
    """Each decode sequence's window blocks (physical ids) and the first in-window slot of its
    first window block, in the representation of the swa-decode-window fix.

    `block_tables[b]` holds sequence b's blocks up to and including the one its decode token is
    written to, `slot_mapping[b][0]` that token's slot, so the query sits at position
    (len - 1) * block_size + slot % block_size. The runner flattens the tables and stores
    -start as the first window block's usage (a lower bound); an empty table (padding) stays
    empty.
    """
    _check_geometry(window, block_size)
    tables, starts = [], []
    for table, slots in zip(block_tables, slot_mapping):
        if not table:
            tables.append(table)
            starts.append(0)
            continue
        pos = (len(table) - 1) * block_size + slots[0] % block_size
        columns = decode_window_blocks(pos, window, block_size)
        tables.append(list(table[columns.start:columns.stop]))
        starts.append(first_window_key(pos, window) % block_size)
    return tables, starts


def mark_single_block_window_starts(block_usage: torch.Tensor, tables: list[list[int]], starts: list[int]) -> None:
    """Store -start as the usage of each sequence's only window block when its window starts
    inside it (a window no longer than the block size can lie in one block).

    The swa-decode-window fix marks the first window block of a multi-block window only: there
    the block is full and its usage is free to carry the lower bound. A window inside one block
    needs both bounds on the block the query is written to; `window_block_end` gives the upper
    one (start + window) where the usage holds the lower. Blocks are laid out sequence by
    sequence, as the runner flattens them.
    """
    offset = 0
    for table, start in zip(tables, starts):
        if len(table) == 1 and start > 0:
            block_usage[offset] = -start
        offset += len(table)


def window_block_end(block_usage: torch.Tensor, block_size: int, window: int) -> torch.Tensor:
    """Per window block, the slot the attended keys stop before: a positive usage (the written
    slots of the query's last block, or a full block) as it is; a negative usage -start (the first
    window block) start + window, at most the block's end. For a multi-block window that is the
    block's end (start + window > block size there); for a window inside one block it is the
    slot after the query (its start is query - window + 1)."""
    usage = block_usage.float()
    return torch.where(usage < 0, (window - usage).clamp(max=block_size), usage)


def prefill_window_context(
    context_blocks: list[list[int]], ctx_lens: list[int], window: int, block_size: int
) -> tuple[list[list[int]], int]:
    """(each prefill sequence's context blocks its chunk can see, the padded width).

    `context_blocks[b]` is sequence b's context block list (ceil(ctx_lens[b] / block_size)
    physical ids); the result keeps `prefill_window_context_blocks` of it, which starts at
    `prefill_window_block_starts`, the frame `prefill_window_bias` assumes. The width,
    `window_block_count`, bounds every sequence's list whatever its context length.
    """
    _check_geometry(window, block_size)
    trimmed = []
    for blocks, ctx in zip(context_blocks, ctx_lens):
        columns = prefill_window_context_blocks(int(ctx), window, block_size)
        trimmed.append(list(blocks[columns.start:columns.stop]))
    return trimmed, window_block_count(window, block_size)


def prefill_window_bias(
    ctx_lens: torch.Tensor,
    query_lens: torch.Tensor,
    window: int,
    block_size: int,
    *,
    num_ctx_blocks: int,
    padded_batch: int,
    padded_query_len: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[padded_batch, 1, S, num_ctx_blocks * block_size + S] additive bias for prefill chunks
    whose context was trimmed by `prefill_window_context` (block list padded to
    `num_ctx_blocks` per sequence). Built where `ctx_lens` lives (the device on HPU); rows past
    the real sequences are padding (they attend their own key only)."""
    ctx = torch.as_tensor(ctx_lens, dtype=torch.int64).reshape(-1)
    qlen = torch.as_tensor(query_lens, dtype=torch.int64).reshape(-1).to(ctx.device)
    if ctx.numel() < padded_batch:  # padding sequences: no context, no queries
        pad = padded_batch - ctx.numel()
        ctx, qlen = torch.cat([ctx, ctx.new_zeros(pad)]), torch.cat([qlen, qlen.new_zeros(pad)])
    ctx, qlen = ctx[:padded_batch], qlen[:padded_batch].clamp(max=padded_query_len)
    mask = prefill_window_mask(
        ctx, qlen, window, block_size,
        ctx_block_starts=prefill_window_block_starts(ctx, window, block_size),
        num_ctx_blocks=num_ctx_blocks, padded_query_len=padded_query_len,
    )
    return mask_to_bias(mask, dtype).unsqueeze(1)
