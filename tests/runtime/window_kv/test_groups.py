"""Window-sized KV rules (beam_hpu/runtime/window_kv/groups.py, and the per-group read oracles of
tests/support/window_kv/oracles.py the other window-KV tests rely on), checked two ways.

Plain: against the exact-window definition (query i sees keys j with i - W < j <= i) and brute
force, for several block sizes and windows that are and are not multiples of them.

Against vLLM itself: Beam's 52-layer pattern gets vLLM's own hybrid grouping and KVCacheConfig,
and a run of vLLM's own KVCacheManager (prefix caching on, a pool small enough that freed blocks
are reused) through chunked prefill, prefix-cache hits, decodes, speculative verify steps with
rejections and finished requests. A simulated device store records, for every slot the rules
write, which key (layer, position, token prefix) it holds; every read the rules make must return
exactly the definition's keys, never a null block, never a key some other request or group wrote
over. Sliding groups must hold no more blocks than the bound.
"""

from __future__ import annotations

import random

import pytest
import torch

from beam_hpu.runtime.sliding_window import hpu_window as win
from beam_hpu.runtime.window_kv import groups as wkv
from tests.support.window_kv import oracles as oracle

# ------------------------------------------------------------------ plain rules


def test_layer_groups_and_shared_buffers():
    groups = [["a0", "a1", "a2"], ["b0", "b1"], ["f0", "f1", "f2"]]
    assert wkv.layer_groups(groups) == {"a0": 0, "a1": 0, "a2": 0, "b0": 1, "b1": 1, "f0": 2, "f1": 2, "f2": 2}
    assert wkv.shared_buffer_layers(groups) == [["a0", "b0", "f0"], ["a1", "b1", "f1"], ["a2", "f2"]]
    with pytest.raises(ValueError, match="in KV-cache groups 0 and 1"):
        wkv.layer_groups([["x"], ["x"]])


def test_group_slots_refuse_null_and_missing_columns():
    table = [0, 0, 7, 9]  # columns 0, 1 freed by the window
    assert oracle.group_slots(table, [8, 11, 12, 15], 4) == [28, 31, 36, 39]
    with pytest.raises(ValueError, match="null block"):
        oracle.group_slots(table, [7], 4)
    with pytest.raises(ValueError, match="outside a table"):
        oracle.group_slots(table, [16], 4)


def decode_read_positions(window_table_len: int, start: int, pos: int, window: int | None, bs: int) -> set[int]:
    """Positions a decode query attends given the runner's (table, start) representation: the
    first window block from slot `start`, the last through the query's own slot."""
    first_col = 0 if window is None else win.decode_window_blocks(pos, window, bs).start
    keys = set()
    for k in range(window_table_len):
        for o in range(bs):
            p = (first_col + k) * bs + o
            if (k == 0 and o < start) or p > pos:
                continue
            keys.add(p)
    return keys


@pytest.mark.parametrize("bs,window", [(4, 8), (4, 7), (4, 5), (4, 1), (16, 40), (128, 512)])
def test_group_decode_tables_exact_over_freed_columns(bs, window):
    rng = random.Random(bs * 1000 + window)
    for pos in list(range(0, window + 4 * bs)) + [100_000 + d for d in range(-bs, bs)]:
        n_cols = pos // bs + 1
        live = win.decode_window_blocks(pos, window, bs)
        ids = rng.sample(range(1, 10 * n_cols + 10), n_cols)
        # Freed columns hold the null block, as vLLM's sliding manager leaves them.
        table = [ids[c] if c >= live.start else wkv.NULL_BLOCK_ID for c in range(n_cols)]
        (t,), (s,) = oracle.group_decode_tables([table], [pos], oracle.GroupGeometry(window), bs)
        assert t == [table[c] for c in live]
        assert decode_read_positions(len(t), s, pos, window, bs) == set(oracle.window_positions(pos, window))
        assert len(t) <= win.window_block_count(window, bs)
        (f,), (fs,) = oracle.group_decode_tables([ids], [pos], oracle.GroupGeometry(None), bs)
        assert f == ids and fs == 0
        if live.start > 0:  # a full-attention read over the freed table reaches the null block
            with pytest.raises(ValueError, match="null block"):
                oracle.group_decode_tables([table], [pos], oracle.GroupGeometry(None), bs)
    assert oracle.group_decode_tables([[]], [-1], oracle.GroupGeometry(window), bs) == ([[]], [0])


@pytest.mark.parametrize("bs,window", [(4, 8), (4, 7), (16, 40), (128, 512)])
def test_group_prefill_context_trims_to_live_blocks(bs, window):
    for ctx in range(0, window + 3 * bs + 2):
        n_cols = -(-ctx // bs)
        reach = win.prefill_window_context_blocks(ctx, window, bs)
        table = [100 + c if c >= reach.start else wkv.NULL_BLOCK_ID for c in range(n_cols)] + [999]
        (trimmed,) = oracle.group_prefill_context([table], [ctx], oracle.GroupGeometry(window), bs)
        assert trimmed == [100 + c for c in reach]
        full_table = [100 + c for c in range(n_cols)]
        assert oracle.group_prefill_context([full_table], [ctx], oracle.GroupGeometry(None), bs) == [full_table]


@pytest.mark.parametrize("bs,window", [(4, 8), (4, 7), (4, 5), (4, 1), (128, 512)])
def test_sliding_blocks_bound_is_tight(bs, window):
    for t in range(1, 3 * bs + 2):
        # Blocks held: from the block of the oldest key the first in-flight token sees through
        # the block of the last in-flight token; the worst case over every alignment.
        worst = max((first + t - 1) // bs - (first - window + 1) // bs + 1
                    for first in range(window, window + 2 * bs))
        assert wkv.sliding_blocks_bound(window, bs, t) == worst
        assert wkv.sliding_blocks_bound(window, bs, t) <= -(-(window - 1 + t) // bs) + 1  # vLLM's cap
    assert wkv.sliding_blocks_bound(window, bs, 1) == win.window_block_count(window, bs)


def test_allocation_windows_keep_the_main_window_only():
    windows = {"a": 512, "b": None, "c": 512, "d": 4096}
    assert wkv.allocation_windows(windows) == {"a": 512, "b": None, "c": 512, "d": None}
    assert wkv.allocation_windows({"a": None}) == {"a": None}


def test_per_layer_metadata_maps_each_layer_to_its_group():
    groups = [["s0", "s1"], ["f0"]]
    sliding, full = object(), object()
    assert wkv.per_layer_metadata([sliding, full], groups) == {"s0": sliding, "s1": sliding, "f0": full}
    with pytest.raises(ValueError, match="1 metadata for 2"):
        wkv.per_layer_metadata([full], groups)


# ------------------------------------------------------------------ one step's grouped metadata


def test_grouped_metadata_per_layer_and_step_view():
    from types import SimpleNamespace

    full = SimpleNamespace(is_prompt=False, block_list=[1, 2, 3], num_blocks=lambda: 3)
    sliding = SimpleNamespace(is_prompt=False, block_list=[3], num_blocks=lambda: 1)
    groups = [["l1", "l3"], ["l0", "l2"]]
    windows = [None, 8]
    md = wkv.GroupedMetadata([full, sliding], groups, wkv.primary_group(windows))
    assert isinstance(md, dict) and md["l1"] is full and md["l0"] is sliding and len(md) == 4
    assert md.block_list == [1, 2, 3] and md.num_blocks() == 3  # the full group's view
    calls = []
    mapped = md.map_groups(lambda m: calls.append(m) or SimpleNamespace(n=len(m.block_list)))
    assert calls == [full, sliding]  # once per group, not once per layer
    assert mapped["l3"].n == 3 and mapped["l2"].n == 1 and mapped.primary == 0
    with pytest.raises(AttributeError):
        md.no_such_field
    import pickle
    again = pickle.loads(pickle.dumps(wkv.GroupedMetadata([1, 2], groups, 1)))
    assert again["l0"] == 2 and again.groups == [1, 2] and again.primary == 1
    assert wkv.primary_group([8, 8, None]) == 2 and wkv.primary_group([8, 8]) == 0
    with pytest.raises(ValueError, match="primary group 2 of 2"):
        wkv.GroupedMetadata([full, sliding], groups, 2)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_distinct_kv_caches_keeps_each_buffer_once_without_storage_pointers(device):
    """Nine shared buffers over 54 layers stay nine when every storage pointer is null (lazy HPU
    tensors report one; meta tensors here), and a view of a buffer counts as that buffer."""
    buffers = [(torch.zeros(2, 4, device=device), torch.zeros(2, 4, device=device)) for _ in range(9)]
    per_layer = [buffers[j] for _ in range(6) for j in range(9)]
    per_layer.append((buffers[3][0][:1], buffers[3][1][:1]))
    kept = wkv.distinct_kv_caches(per_layer)
    assert len(kept) == 9 and all(a is b for a, b in zip(kept, buffers))

