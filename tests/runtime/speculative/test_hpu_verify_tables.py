"""A speculative verify step's k+1 decode tokens each get their own causal and sliding window.

The rows are laid out as vllm-gaudi's decode path lays them (row s * num_tokens + j, one token
each, the slot of position ctx + j); what a row attends is read with the rule vllm-gaudi's
paged decode applies (every table block full but the last, the last up to the row's slot offset)
and, for sliding layers, through beam_hpu.runtime.sliding_window.hpu_window.decode_window_tables. Both must equal the
definition: the query at p attends 0..p (full) and p-W+1..p (sliding).
"""

import pytest
import torch

from beam_hpu.runtime.sliding_window import hpu_window as win
from beam_hpu.runtime.speculative.hpu_verify_tables import verify_step_block_tables

K = 4  # drafts per verify step: rows carry positions ctx .. ctx + K


def layout(ctx_lens, n_tokens, bs, max_blocks=64):
    table = torch.stack([torch.arange(1000 * (s + 1), 1000 * (s + 1) + max_blocks) for s in range(len(ctx_lens))])
    slots = [[int(table[s, (c + j) // bs]) * bs + (c + j) % bs] for s, c in enumerate(ctx_lens) for j in range(n_tokens)]
    return table, slots


def full_attention_keys(row_table, slot, bs):
    """vllm-gaudi's paged decode: all blocks of the row's table full but the last, which holds
    slot % bs + 1 keys; positions are table columns (physical id - base)."""
    base = row_table[0]
    last = len(row_table) - 1
    return {(b - base) * bs + o for i, b in enumerate(row_table) for o in range(bs if i < last else slot % bs + 1)}


def sliding_keys(row_table, start, pos_cap_table, bs):
    first_col = row_table[0] - pos_cap_table
    return {(first_col + i) * bs + o for i in range(len(row_table)) for o in range(bs) if i > 0 or o >= start}


def stock_tables(table, ctx_lens, n_tokens, bs):
    return [table[s, :c // bs + 1].tolist() for s, c in enumerate(ctx_lens) for _ in range(n_tokens)]


@pytest.mark.parametrize("bs,w", [(4, 8), (4, 6), (8, 16), (128, 512)])
def test_every_verify_row_attends_its_own_positions(bs, w):
    edges = [0, bs, 2 * bs, w, w + bs, 5 * bs]
    ctx_lens = sorted({max(0, e + d) for e in edges for d in range(-K - 1, 2)})
    table, slots = layout(ctx_lens, K + 1, bs)
    rows = verify_step_block_tables(table, ctx_lens, [K + 1] * len(ctx_lens), K + 1, bs)
    win_tables, starts = win.decode_window_tables(rows, slots, w, bs)
    for r, (row, slot) in enumerate(zip(rows, slots)):
        s, j = divmod(r, K + 1)
        p = ctx_lens[s] + j
        base = 1000 * (s + 1)
        assert full_attention_keys(row, slot[0], bs) == set(range(p + 1)), (ctx_lens[s], j)
        keys = {k for k in sliding_keys(win_tables[r], starts[r], base, bs) if k <= p}
        assert keys == set(range(max(0, p - w + 1), p + 1)), (ctx_lens[s], j)


@pytest.mark.parametrize("bs,w", [(4, 8), (128, 512)])
def test_the_stock_rows_are_wrong_exactly_past_a_block_boundary(bs, w):
    ctx_lens = [bs - 2, bs - 1, 3 * bs - 3, bs + 1]
    table, slots = layout(ctx_lens, K + 1, bs)
    stock = stock_tables(table, ctx_lens, K + 1, bs)
    for r, (row, slot) in enumerate(zip(stock, slots)):
        s, j = divmod(r, K + 1)
        crosses = ctx_lens[s] % bs + j >= bs
        assert (full_attention_keys(row, slot[0], bs) == set(range(ctx_lens[s] + j + 1))) is not crosses


def test_padding_rows_keep_the_stock_table_and_a_short_table_is_refused():
    bs = 4
    table, _ = layout([6, 3], 3, bs, max_blocks=3)
    rows = verify_step_block_tables(table, [6, 3], [3, 1], 3, bs)
    assert rows[0] == table[0, :2].tolist() and rows[2] == table[0, :3].tolist()  # 6, 7 | 8
    assert rows[3] == rows[4] == rows[5] == table[1, :1].tolist()  # one real token, two padding rows
    with pytest.raises(ValueError, match="sequence 0 needs 4 blocks for position 12"):
        verify_step_block_tables(table, [10, 0], [3, 1], 3, bs)
