"""Exact sliding windows over paged KV, checked against the definition (query i sees keys j with
i - W < j <= i) at every position near block and window edges, for several block sizes and
windows that are and are not multiples of the block size. vllm-gaudi's block-granular decode rule
is written out below and shown to fail the same check, so the check bites."""

from __future__ import annotations

import pytest
import torch

from beam_hpu.runtime.sliding_window import hpu_window as win

BLOCK_SIZES = (16, 32, 128)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    # Many small tensor ops: on a shared 2-core host torch's thread pool contends with other
    # processes and makes this module ten times slower than on one thread.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def windows_for(bs: int) -> list[int]:
    # Multiples of the block size, remainders 1 and bs-1 and one in between, tiny windows, and Beam's.
    return sorted({1, 2, bs - 1, bs, bs + 1, 4 * bs - 1, 4 * bs, 4 * bs + 1, 4 * bs + 5, 512})


GEOMETRIES = [(bs, w) for bs in BLOCK_SIZES for w in windows_for(bs)]


def edge_positions(bs: int, w: int) -> list[int]:
    # Every position until the window has slid over several blocks, then spots near the
    # block and window edges far out (up to 256K context).
    near = range(0, w + 3 * bs + 2)
    far = [p + d for p in (100_000, 100_000 + w, 262_143 - bs) for d in range(-bs - 1, bs + 2)]
    return sorted(set(near) | set(far))


def reference_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, w: int) -> torch.Tensor:
    """The definition: [Q, K] True where query i may attend key j (j >= 0 and i - W < j <= i)."""
    i, j = query_pos[:, None], key_pos[None, :]
    return (j >= 0) & (j > i - w) & (j <= i)


def to_dense(key_pos: torch.Tensor, size: int) -> torch.Tensor:
    """[..., M] key positions (-1 = none) -> [..., size] bool; refuses keys outside 0..size-1, so
    nothing attended can hide outside the compared range."""
    assert ((key_pos >= -1) & (key_pos < size)).all(), "an attended key lies outside the compared range"
    dense = torch.zeros(*key_pos.shape[:-1], size + 1, dtype=torch.bool)
    dense.scatter_(-1, torch.where(key_pos >= 0, key_pos, size), True)
    return dense[..., :size]


def decode_keys_near_query(result: win.DecodeWindow, pos: torch.Tensor, w: int, bs: int):
    """[B, R] attended keys at positions pos - w - 2*bs + r, r < R = w + 3*bs: a neighbourhood of
    each query wide enough to show any key a block-granular or off-by-one rule would touch."""
    key_pos = result.block_index.unsqueeze(-1) * bs + torch.arange(bs)  # [B, n, bs]
    key_pos = key_pos.masked_fill(~result.slot_mask, -1).flatten(1)  # [B, n*bs]
    base = (pos - w - 2 * bs).unsqueeze(1)  # [B, 1]
    assert ((key_pos < 0) | (key_pos >= base)).all(), "an attended key lies far before the window"
    return to_dense(torch.where(key_pos >= 0, key_pos - base, -1), w + 3 * bs), base


def vllm_gaudi_block_granular_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, w: int, bs: int):
    """vllm-gaudi's decode window as the runner builds it (non-gpt_oss): the last W//bs blocks of
    the block table, masked only past the last block's usage."""
    rows = []
    for pos in query_pos.tolist():
        num_blocks = pos // bs + 1
        blocks = range(max(0, num_blocks - w // bs), num_blocks)
        last_usage = pos % bs + 1
        seen = {b * bs + s for b in blocks for s in range(bs if b < num_blocks - 1 else last_usage)}
        rows.append([k in seen for k in key_pos.tolist()])
    return torch.tensor(rows, dtype=torch.bool)


def test_window_block_count_is_tight_and_can_exceed_w_div_bs_plus_one():
    for bs, w in GEOMETRIES:
        pos = torch.tensor(edge_positions(bs, w))
        used = (win.decode_window(pos, w, bs).block_index >= 0).sum(1)
        assert int(used.max()) == win.window_block_count(w, bs), (bs, w)
        if w % bs in (0, 1):
            assert win.window_block_count(w, bs) == w // bs + 1
        else:  # e.g. W = 4*bs + 5 with its first key in a block's last slot spans 6 blocks
            assert win.window_block_count(w, bs) == w // bs + 2
    assert win.window_block_count(512, 128) == 5  # Beam-1.0 on HPU


@pytest.mark.parametrize("bs, w", GEOMETRIES)
def test_decode_window_is_exact(bs, w):
    pos = torch.tensor(edge_positions(bs, w))
    mine, base = decode_keys_near_query(win.decode_window(pos, w, bs), pos, w, bs)
    key_pos = base + torch.arange(w + 3 * bs)  # [B, R]
    i, j = pos[:, None], key_pos
    expected = (j >= 0) & (j > i - w) & (j <= i)  # the definition, row by row
    assert torch.equal(mine, expected)


@pytest.mark.parametrize("bs, w", GEOMETRIES)
def test_decode_window_blocks_are_the_tail_and_none_is_wasted(bs, w):
    pos = torch.tensor(edge_positions(bs, w))
    result = win.decode_window(pos, w, bs)
    used = result.block_index >= 0
    for row, p in enumerate(pos.tolist()):
        taken = result.block_index[row][used[row]].tolist()
        assert taken == list(win.decode_window_blocks(p, w, bs))
        assert taken[-1] == p // bs  # ends at the query's own block
        assert not used[row][len(taken):].any()  # left-aligned, -1 after
    # Every block taken holds at least one attended key: flat paged attention never sees a
    # block whose scores are all -inf.
    assert torch.equal(result.slot_mask.any(-1), used)


def test_single_query_mask_matches_the_batch():
    bs, w = 32, 100
    for p in (0, 31, 32, 99, 100, 131, 1000):
        mask = win.decode_window_slot_mask(p, w, bs)
        blocks = win.decode_window_blocks(p, w, bs)
        assert mask.shape == (len(blocks), bs)
        keys = {b * bs + s for i, b in enumerate(blocks) for s in range(bs) if mask[i, s]}
        assert keys == set(range(max(0, p - w + 1), p + 1))


def test_padding_rows_get_no_blocks():
    result = win.decode_window([5, -1, 700], 512, 128)
    assert (result.block_index[1] == -1).all() and not result.slot_mask[1].any()
    assert result.block_index.shape == (3, 5) and result.slot_mask.shape == (3, 5, 128)


def test_flat_layout_uses_physical_ids_and_exact_masks():
    bs, w = 16, 50
    positions = [0, 15, 16, 49, 50, 67, 200, -1]
    generator = torch.Generator().manual_seed(0)
    block_table = torch.randperm(1000, generator=generator)[: 8 * 20].reshape(8, 20)
    block_list, block_groups, slot_mask = win.flat_decode_window(block_table, positions, w, bs)
    assert block_list.shape[0] == block_groups.shape[0] == slot_mask.shape[0]
    for row, p in enumerate(positions):
        mine = block_groups == row
        if p < 0:
            assert not mine.any()
            continue
        columns = [(block_table[row] == bid).nonzero().item() for bid in block_list[mine].tolist()]
        keys = {c * bs + s for c, m in zip(columns, slot_mask[mine]) for s in range(bs) if m[s]}
        assert keys == set(range(max(0, p - w + 1), p + 1)), p


@pytest.mark.parametrize("bs, w", [g for g in GEOMETRIES if g[1] > g[0]])
def test_vllm_gaudi_block_granular_rule_fails_the_same_check(bs, w):
    # The rule the port replaces, through the same comparison as test_decode_window_is_exact.
    pos = torch.arange(0, w + 3 * bs)
    key_pos = torch.arange(0, w + 3 * bs)
    expected = reference_mask(pos, key_pos, w)
    old = vllm_gaudi_block_granular_mask(pos, key_pos, w, bs)
    wrong = (old != expected).any(1)
    assert wrong.any(), "the old rule should drop in-window keys"
    # It drops the oldest in-window keys (never adds out-of-window ones) once the window is full.
    assert not (old & ~expected).any()
    assert wrong[w:].float().mean() > 0.5
    result = win.decode_window(pos, w, bs)
    key_of_slot = (result.block_index.unsqueeze(-1) * bs + torch.arange(bs)).masked_fill(~result.slot_mask, -1)
    assert torch.equal(to_dense(key_of_slot.flatten(1), key_pos.numel()), expected)


# Prefill with cached context -------------------------------------------------------------------


def ctx_edges(bs: int, w: int) -> list[int]:
    points = {0, 1, bs - 1, bs, bs + 1, 2 * bs, w - 1, w, w + 1, w + bs - 1, w + bs, 3 * w + 7}
    return sorted(p for p in points if p >= 0)


def prefill_keys_dense(mask_rows, ctx, query_len, start, num_ctx_blocks, bs, lo):
    """[query_len, ctx + query_len - lo]: one sequence's real query rows re-expressed over the
    absolute key positions lo..ctx+query_len-1, after checking that no padding column and no key
    before lo is attended."""
    padded = mask_rows.shape[-1] - num_ctx_blocks * bs
    slot_pos = start * bs + torch.arange(num_ctx_blocks * bs)
    column_pos = torch.cat([slot_pos, ctx + torch.arange(padded)])  # distinct, by the layout
    column_real = torch.cat([slot_pos < ctx, torch.arange(padded) < query_len])
    rows = mask_rows[:query_len]
    assert not rows[:, ~column_real].any(), "a padding column is attended"
    assert not rows[:, column_real & (column_pos < lo)].any(), "a key far before the window is attended"
    compared = column_real & (column_pos >= lo)
    dense = torch.zeros(query_len, ctx + query_len - lo, dtype=torch.bool)
    dense[:, column_pos[compared] - lo] = rows[:, compared]
    return dense


@pytest.mark.parametrize("bs, w", [(bs, w) for bs in BLOCK_SIZES for w in (bs, 4 * bs, 4 * bs + 5, 3 * bs - 1)])
@pytest.mark.parametrize("trimmed", [False, True], ids=["full-context", "window-trimmed"])
def test_prefill_mask_is_exact(bs, w, trimmed):
    ctx_lens = ctx_edges(bs, w)
    for query_len in (1, 2, bs - 1, bs, bs + 1, w + 3):
        qlens = [query_len] * len(ctx_lens)
        padded = query_len + 3
        if trimmed:
            starts = win.prefill_window_block_starts(ctx_lens, w, bs)
            num_ctx_blocks = win.window_block_count(w, bs)
        else:
            starts = torch.zeros(len(ctx_lens), dtype=torch.int64)
            num_ctx_blocks = -(-max(ctx_lens) // bs) + 1  # one padding block too
        mask = win.prefill_window_mask(
            ctx_lens, qlens, w, bs, ctx_block_starts=starts, num_ctx_blocks=num_ctx_blocks, padded_query_len=padded
        )
        assert mask.shape == (len(ctx_lens), padded, num_ctx_blocks * bs + padded)
        for b, ctx in enumerate(ctx_lens):
            lo = max(0, ctx - w - 2 * bs)  # keys before lo are out of every row's window by a margin
            mine = prefill_keys_dense(mask[b], ctx, query_len, int(starts[b]), num_ctx_blocks, bs, lo)
            query_pos = torch.arange(ctx, ctx + query_len)
            expected = reference_mask(query_pos, torch.arange(lo, ctx + query_len), w)
            assert torch.equal(mine, expected), (ctx, query_len)
            # Padding query rows see their own key column only: no empty softmax row.
            own = num_ctx_blocks * bs + torch.arange(query_len, padded)
            pad_rows = mask[b, query_len:]
            assert (pad_rows.sum(-1) == 1).all() and pad_rows[torch.arange(padded - query_len), own].all()


@pytest.mark.parametrize("bs, w", GEOMETRIES)
def test_trimmed_context_blocks_fit_and_agree(bs, w):
    starts = win.prefill_window_block_starts(ctx_edges(bs, w), w, bs)
    for ctx, start in zip(ctx_edges(bs, w), starts.tolist()):
        blocks = win.prefill_window_context_blocks(ctx, w, bs)
        assert len(blocks) <= win.window_block_count(w, bs)
        if len(blocks):
            assert blocks.start == start and blocks.stop == -(-ctx // bs)
        needed = set(range(max(0, ctx - w + 1), ctx))  # context keys the first query sees
        assert needed == {k for k in needed if k // bs in blocks}


def test_default_layout_is_the_full_context():
    mask = win.prefill_window_mask([300], [10], 128, 128)
    assert mask.shape == (1, 10, 3 * 128 + 10)
    explicit = win.prefill_window_mask([300], [10], 128, 128, ctx_block_starts=[0], num_ctx_blocks=3, padded_query_len=10)
    assert torch.equal(mask, explicit)


@pytest.mark.parametrize("bad", [dict(window=0), dict(block_size=0)])
def test_bad_geometry_is_refused(bad):
    geometry = dict(window=512, block_size=128) | bad
    with pytest.raises(ValueError):
        win.window_block_count(**geometry)
    with pytest.raises(ValueError):
        win.decode_window([1], **geometry)


def test_mask_to_bias():
    mask = torch.tensor([[True, False], [False, True]])
    bias = win.mask_to_bias(mask, torch.float32)
    assert torch.equal(bias == 0, mask) and torch.isinf(bias[~mask]).all() and (bias[~mask] < 0).all()
    assert win.mask_to_bias(mask).dtype == torch.bfloat16


def test_geometry_list_covers_both_kinds_of_window():
    assert any(w % bs == 0 for bs, w in GEOMETRIES) and any(w % bs > 1 for bs, w in GEOMETRIES)


# ---------------------------------------------------------------- the runner-facing layouts

@pytest.mark.parametrize("bs, w", GEOMETRIES)
def test_decode_window_tables_are_the_exact_window(bs, w):
    """decode_window_tables (what the decode runner patch calls) in the swa-decode-window layout:
    blocks from the table, a first-slot lower bound; every key it leaves attended is in the
    window and every window key is attended."""
    positions = edge_positions(bs, w)[:200]
    tables = [[10_000 + b for b in range(p // bs + 1)] for p in positions]
    slots = [[t[-1] * bs + p % bs] for t, p in zip(tables, positions)]
    got_tables, starts = win.decode_window_tables(tables + [[]], slots + [[0]], w, bs)
    assert got_tables[-1] == [] and starts[-1] == 0  # padding stays empty
    for p, table, start in zip(positions, got_tables, starts):
        first_col = table[0] - 10_000
        assert table == list(range(table[0], table[0] + len(table))) and table[-1] - 10_000 == p // bs
        attended = {(first_col + i) * bs + s for i in range(len(table)) for s in range(bs)
                    if (i > 0 or s >= start) and (first_col + i) * bs + s <= p}
        assert attended == set(range(max(0, p - w + 1), p + 1)), p
        assert len(table) <= win.window_block_count(w, bs)


@pytest.mark.parametrize("bs, w", [(16, 64), (16, 21), (128, 512)])
def test_prefill_window_context_and_bias_agree(bs, w):
    ctx_lens = [0, 1, w - 1, w, w + 1, 5 * bs + 3]
    blocks = [[500 + b for b in range(-(-c // bs))] for c in ctx_lens]
    trimmed, width = win.prefill_window_context(blocks, ctx_lens, w, bs)
    assert width == win.window_block_count(w, bs)
    starts = win.prefill_window_block_starts(ctx_lens, w, bs).tolist()
    for ctx, full, kept, start in zip(ctx_lens, blocks, trimmed, starts):
        assert kept == full[start:start + len(kept)] and len(kept) <= width
        assert kept == [] or kept[-1] == full[-1]
    qlens = [3, 2, 1, 4, 5, 2]
    bias = win.prefill_window_bias(torch.tensor(ctx_lens), torch.tensor(qlens), w, bs, num_ctx_blocks=width,
                                   padded_batch=len(ctx_lens) + 1, padded_query_len=6, dtype=torch.float32)
    assert bias.shape == (len(ctx_lens) + 1, 1, 6, width * bs + 6)
    mask = win.prefill_window_mask(ctx_lens + [0], qlens + [0], w, bs, ctx_block_starts=starts + [0],
                                   num_ctx_blocks=width, padded_query_len=6)
    assert torch.equal(bias[:, 0] == 0, mask)
