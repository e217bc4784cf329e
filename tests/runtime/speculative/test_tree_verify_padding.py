"""beam-exact-window on the KV writes of a speculative verify step's padding rows, against the
vllm-gaudi tree named by GAUDI_FIXES_ROOT (skipped without it).

A verify step where sequences carry different numbers of drafts (prompt lookup proposes fewer or
none, the grammar trims drafts) has padding rows: row j >= num_tokens[s] of sequence s. The
file's whole _create_decode_input_data builds the step (tests/support/gaudi/decode_step.py), then the file's own
VLLMKVCache.forward writes one layer's K at the step's slot mapping, as the HPU attention does.
Stock vllm-gaudi pads a sequence's positions with 0, so its padding rows write over the K/V of
its position 0 (and, through a prefix-cached block, another request's); with the port they write
to the pad block only.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.gaudi.decode_step import NUM_KV_BLOCKS, cached_keys, padded_step, write_kv
from tests.support.gaudi.tree import port_tree_fixture

pytestmark = pytest.mark.gaudi_tree
tree = port_tree_fixture()


@pytest.mark.parametrize("bs", [4, 16])
def test_padding_rows_never_write_over_cached_keys(tree, bs):
    # 4, 1 and 2 drafts: rows of 5, padded to 4 sequences; sequence 1's first (full) block is
    # sequence 0's
    context_lens, num_tokens = [2 * bs + 1, bs + 2, 3 * bs - 3], [5, 2, 3]
    tables, out = padded_step(tree, bs, context_lens, num_tokens)
    slots = out.attn_metadata.slot_mapping.flatten()
    rows = len(slots)
    assert rows == 4 * 5  # padded batch of 4 sequences x 5 rows
    cache = torch.arange((NUM_KV_BLOCKS + 1) * bs, dtype=torch.float32)  # the pool and its pad block
    before = cache.clone()
    values = -1.0 - torch.arange(rows, dtype=torch.float32)  # each row's K, distinct
    cache = write_kv(tree.root / "vllm_gaudi/extension/utils.py", cache, slots, values)
    written = {i for i in range(len(cache)) if cache[i] != before[i]}
    overwritten = {(s, p) for slot, s, p in cached_keys(tables, context_lens, bs) if slot in written}

    # Every real row wrote its own position's slot
    for s, (c, n) in enumerate(zip(context_lens, num_tokens)):
        for j in range(n):
            slot = int(tables[s, (c + j) // bs]) * bs + (c + j) % bs
            assert int(slots[s * 5 + j]) == slot and cache[slot] == values[s * 5 + j], (s, j)
    if not tree.port:
        # vllm-gaudi: sequences 1 and 2's padding rows hit their position 0, and sequence 0's
        # position 0 with it (sequence 1 shares its first block through the prefix cache)
        assert overwritten == {(0, 0), (1, 0), (2, 0)}
        return
    assert overwritten == set()
    pad_base = NUM_KV_BLOCKS * bs
    padding = [s * 5 + j for s in range(4) for j in range(5) if s >= len(num_tokens) or j >= num_tokens[s]]
    pad_slots = [int(slots[r]) for r in padding]
    assert all(pad_base <= p < pad_base + bs for p in pad_slots)
    assert len(set(pad_slots)) == min(len(pad_slots), bs)  # the runner's cycle: distinct while the block lasts


def test_no_real_row_attends_the_pad_block_and_positions_keep_the_layout(tree):
    bs = 4
    context_lens, num_tokens = [9, 6, 13], [5, 2, 3]
    tables, out = padded_step(tree, bs, context_lens, num_tokens)
    meta = out.attn_metadata
    real_rows = {s * 5 + j for s, n in enumerate(num_tokens) for j in range(n)}
    # the pad block is in no row's attended blocks (it only ever holds padding K/V)
    for blocks, groups in ((meta.block_list, meta.block_groups), (meta.window_block_list, meta.window_block_groups)):
        used = [(int(b), int(g)) for b, g in zip(blocks, groups) if g >= 0]
        assert all(b != NUM_KV_BLOCKS for b, g in used if g in real_rows)
    # positions and token ids keep vllm-gaudi's layout: padding rows at position 0, token 0
    positions = out.position_ids.flatten().tolist()
    for s, (c, n) in enumerate(zip(context_lens, num_tokens)):
        assert positions[s * 5:s * 5 + 5] == [c + j for j in range(n)] + [0] * (5 - n)


def test_steps_without_padding_rows_and_other_models_keep_the_stock_slots(tree):
    bs = 4
    # every sequence carries all its rows: nothing to move
    tables, out = padded_step(tree, bs, [9, 6, 13], [5, 5, 5], padded_batch=3)
    want = [int(tables[s, (c + j) // bs]) * bs + (c + j) % bs for s, c in enumerate([9, 6, 13]) for j in range(5)]
    assert out.attn_metadata.slot_mapping.flatten().tolist() == want
    # another model type keeps vllm-gaudi's slots, padding rows included (position 0's slot)
    tables, out = padded_step(tree, bs, [9, 6], [3, 1], padded_batch=2, shared_first_block=False, model_type="gemma3")
    slots = out.attn_metadata.slot_mapping.flatten().tolist()
    assert slots[4:6] == [int(tables[1, 0]) * bs] * 2
