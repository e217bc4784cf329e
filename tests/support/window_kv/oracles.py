"""The exact-window definition and the per-group reads a window-sized cache must give, as oracles
the window-KV tests check runners against (no runner calls them).

A query at position i of a layer with window W attends keys j with i - W < j <= i (a full layer:
every j <= i). A sliding group's table keeps the logical column order, freed columns holding the
null block, so beam_hpu.runtime.sliding_window.hpu_window's exact-window functions apply to it; the
functions below add the per-group bookkeeping and refuse a read or write of a null or missing
block. Positions and columns are 0-based; column c of a table holds positions c*bs .. c*bs+bs-1.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from beam_hpu.runtime.sliding_window.hpu_window import (
    _check_geometry,
    decode_window_blocks,
    decode_window_tables,
    prefill_window_context,
    prefill_window_context_blocks,
)
from beam_hpu.runtime.window_kv.groups import NULL_BLOCK_ID


def window_positions(pos: int, window: int | None) -> range:
    """The positions a query at `pos` attends: the exact window, or everything through it."""
    return range(0 if window is None else max(0, pos - window + 1), pos + 1)


def keys_read(cache, blocks, owners, bias, rows: int, block_size: int) -> list[list[int]]:
    """Per batch row, the key codes a decode row reads from `cache` through a block list, its
    block-to-row mapping and its mask (0 = attended), in block-list order."""
    got = [[] for _ in range(rows)]
    for i, (bid, row) in enumerate(zip(blocks, owners)):
        if 0 <= row < rows:
            got[row] += [int(cache[bid * block_size + o]) for o in range(block_size) if bias[i, o] == 0]
    return got


def window_columns_live(table: Sequence[int], columns: range, null_block: int = NULL_BLOCK_ID) -> None:
    """Raise unless every column in `columns` exists in `table` and holds a real block."""
    if columns.start < 0 or columns.stop > len(table):
        raise ValueError(f"columns {columns.start}..{columns.stop - 1} outside a table of {len(table)} blocks")
    dead = [c for c in columns if table[c] == null_block]
    if dead:
        raise ValueError(f"columns {dead} hold the null block but the window reaches them")


def group_slots(table: Sequence[int], positions: Sequence[int], block_size: int,
                null_block: int = NULL_BLOCK_ID) -> list[int]:
    """Slots (block_id * block_size + offset) where the keys at `positions` are written in a
    group whose table is `table`. A position whose column is missing or freed is an error: a
    write there would land in the null block or in another request's block."""
    _check_geometry(1, block_size)
    slots = []
    for pos in positions:
        col = pos // block_size
        window_columns_live(table, range(col, col + 1), null_block)
        slots.append(table[col] * block_size + pos % block_size)
    return slots


@dataclass(frozen=True)
class GroupGeometry:
    """What the runner needs to know about one KV-cache group: its window (None = full)."""

    sliding_window: int | None


def group_decode_tables(
    tables: Sequence[Sequence[int]], positions: Sequence[int], geometry: GroupGeometry, block_size: int,
    null_block: int = NULL_BLOCK_ID,
) -> tuple[list[list[int]], list[int]]:
    """One group's decode block tables and first in-window slots, for queries at `positions`.

    `tables[b]` is request b's table in this group (at least through the block of its query).
    A full group reads every block through the query's; a sliding group reads its exact window
    (`window.decode_window_tables`), which must hold only live blocks. A negative position is a
    padding row: empty table. Returns (tables, starts) in the swa-decode-window representation.
    """
    out_tables, starts = [], []
    for table, pos in zip(tables, positions):
        if pos < 0:
            out_tables.append([])
            starts.append(0)
            continue
        last = pos // block_size
        if geometry.sliding_window is None:
            window_columns_live(table, range(0, last + 1), null_block)
            out_tables.append(list(table[:last + 1]))
            starts.append(0)
            continue
        window_columns_live(table, decode_window_blocks(pos, geometry.sliding_window, block_size), null_block)
        through = list(table[:last + 1])
        (window_table,), (start,) = decode_window_tables(
            [through], [[through[-1] * block_size + pos % block_size]], geometry.sliding_window, block_size)
        out_tables.append(window_table)
        starts.append(start)
    return out_tables, starts


def group_prefill_context(
    tables: Sequence[Sequence[int]], ctx_lens: Sequence[int], geometry: GroupGeometry, block_size: int,
    null_block: int = NULL_BLOCK_ID,
) -> list[list[int]]:
    """One group's context blocks for prefill chunks starting at `ctx_lens`: the whole context
    for a full group, the window-trimmed context (`window.prefill_window_context`) for a sliding
    group; every block returned must be live."""
    out = []
    for table, ctx in zip(tables, ctx_lens):
        n_ctx_blocks = -(-int(ctx) // block_size)
        if geometry.sliding_window is None:
            columns = range(0, n_ctx_blocks)
        else:
            columns = prefill_window_context_blocks(int(ctx), geometry.sliding_window, block_size)
        window_columns_live(table, columns, null_block)
        if geometry.sliding_window is None:
            out.append(list(table[:n_ctx_blocks]))
        else:
            (trimmed,), _ = prefill_window_context([list(table[:n_ctx_blocks])], [int(ctx)],
                                                   geometry.sliding_window, block_size)
            out.append(trimmed)
    return out
