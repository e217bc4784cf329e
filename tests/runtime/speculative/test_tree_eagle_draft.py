"""vllm-gaudi's EAGLE drafter path (v1/spec_decode/hpu_eagle.py and the runner's
propose_eagle_decode) under the port, against the vllm-gaudi tree named by GAUDI_FIXES_ROOT
(skipped without it).

The drafter's first pass runs on the verify step's own decode metadata: propose_eagle_decode
hands decode_data.attn_metadata through HpuEagleProposer.prepare_inputs unchanged, so the
drafter's K/V of that pass lands at the target's slots, rows whose input prepare_inputs marks -1
(rejected drafts, padding) included. Its later steps build their own metadata
(prepare_attn_metadata), one row per sequence at the next position. What runs is the file's code
(its _create_decode_input_data, _prepare_spec_decode_inputs, propose_eagle_decode,
prepare_inputs, prepare_attn_metadata, get_habana_paged_attn_buffers and VLLMKVCache.forward);
stand-ins only for the drafter model's forward (HPU-only: it records its inputs) and the
metadata records.
"""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.support.gaudi.decode_step import (NUM_KV_BLOCKS, PaddedBatch, cached_keys, decode_functions, padded_step,
                                             write_kv)
from tests.support.gaudi.source import RUNNER_CLS, load
from tests.support.gaudi.tree import port_tree_fixture

pytestmark = pytest.mark.gaudi_tree
tree = port_tree_fixture()

EAGLE = "vllm_gaudi/v1/spec_decode/hpu_eagle.py"
PROPOSER_CLS = "HpuEagleProposer"


def metadata_record(**kw):
    return SimpleNamespace(**kw)


def proposer(tree, max_model_len, num_speculative_tokens):
    """The tree's HpuEagleProposer methods that build inputs and metadata, on a plain namespace."""
    names = dict(torch=torch, itertools=itertools, async_h2d_copy=lambda t, device=None, dtype=None: t,
                 HPUAttentionMetadataV1=SimpleNamespace(make_decode_metadata=metadata_record))
    path = tree.root / EAGLE
    drafter = SimpleNamespace(device="cpu", max_model_len=max_model_len, num_speculative_tokens=num_speculative_tokens)
    for name in ("prepare_inputs", "prepare_attn_metadata"):
        method = load(path, name, PROPOSER_CLS, **names)
        setattr(drafter, name, lambda *a, _m=method, **k: _m(drafter, *a, **k))
    return drafter


def draft_runner(tree, block_size, model_type="beam"):
    """What prepare_attn_metadata reads of the runner, with the file's get_habana_paged_attn_buffers."""
    _, paged = decode_functions(tree.runner)
    runner = SimpleNamespace(block_size=block_size, attn_block_size=block_size, use_contiguous_pa=False,
                             _PAD_BLOCK_ID=NUM_KV_BLOCKS, _PAD_SLOT_ID=NUM_KV_BLOCKS * block_size,
                             defragmenter=SimpleNamespace(resolve=lambda b: b, resolve_all=lambda t: t),
                             _get_model_type=lambda: model_type, bucketing_manager=PaddedBatch(1),
                             get_dp_padding=lambda n: 0, model_config=SimpleNamespace(dtype=torch.float32))
    runner.get_habana_paged_attn_buffers = lambda *a, **k: paged(runner, *a, **k)
    return runner


# ------------------------------------------------------------- the first draft pass

def test_first_draft_pass_writes_the_drafter_cache_at_the_verify_steps_slots(tree):
    """Sequences with 4, 1 and 2 drafts (accepting 2, 1 and 0), padded to 4 sequences of 5 rows;
    sequence 1 shares sequence 0's first block through the prefix cache. The drafter's K of the
    first pass is written with the tree's cache write at the slots propose_eagle_decode hands on."""
    bs, k = 4, 4
    context_lens, num_tokens, accepted = [2 * bs + 1, bs + 2, 3 * bs - 3], [5, 2, 3], [2, 1, 0]
    tables, out = padded_step(tree, bs, context_lens, num_tokens)
    rows = out.attn_metadata.slot_mapping.numel()
    assert rows == 4 * 5

    # the tree's spec-decode metadata of the step (num_draft_tokens over the padded batch)
    spec_inputs = load(tree.runner, "_prepare_spec_decode_inputs", RUNNER_CLS, np=np, torch=torch,
                       SpecDecodeMetadata=metadata_record)
    cumsum = load(tree.runner, "_get_cumsum_and_arange", RUNNER_CLS, np=np)
    req_ids = [f"r{s}" for s in range(3)]
    runner = SimpleNamespace(device="cpu", arange_np=np.arange(64),
                             input_batch=SimpleNamespace(req_id_to_index={r: s for s, r in enumerate(req_ids)}))
    runner._get_cumsum_and_arange = lambda *a, **kw: cumsum(runner, *a, **kw)
    scheduled = SimpleNamespace(scheduled_spec_decode_tokens={r: [9] * (n - 1) for r, n in zip(req_ids, num_tokens)})
    _, out.spec_decode_metadata = spec_inputs(runner, scheduled, out.logits_indices, out.token_ids, 5)
    assert out.spec_decode_metadata.num_draft_tokens == [4, 1, 2, 0]

    # the verify step's outcome: sequence s keeps accepted[s] drafts and one new token; -1 pads
    sampled = torch.full((4, 5), -1, dtype=torch.int64)
    for s, a in enumerate(accepted):
        sampled[s, :a + 1] = 50 + 10 * s + torch.arange(a + 1)
    sampled[3, 0] = 90
    sampled_lists = [[int(t) for t in row if t >= 0] for row in sampled]
    hidden = torch.arange(rows, dtype=torch.float32).view(rows, 1)  # each verify row's hidden state: its row

    recorded = {}
    drafter = proposer(tree, max_model_len=1024, num_speculative_tokens=k)
    drafter.propose = lambda *args: recorded.update(args=args) or torch.zeros(4, k, dtype=torch.int64)
    runner.drafter = drafter
    runner.use_aux_hidden_state_outputs = False
    runner.input_batch.block_table = [SimpleNamespace(get_cpu_tensor=lambda: tables)]
    propose_decode = load(tree.runner, "propose_eagle_decode", RUNNER_CLS, torch=torch)
    propose_decode(runner, sampled_lists, sampled, hidden, None, 3, out)
    token_ids, positions, hidden_in, last_rows, metadata, block_table, _ = recorded["args"]
    assert metadata is out.attn_metadata  # the verify step's own metadata, as the port edits it
    assert block_table.shape[0] == 3

    # the drafter's K of each row: the hidden state the row was given (its source row)
    cache = torch.full(((NUM_KV_BLOCKS + 1) * bs, ), -1.0)
    cache = write_kv(tree.root / "vllm_gaudi/extension/utils.py", cache, metadata.slot_mapping,
                     hidden_in.reshape(-1).clone())
    slot_of = lambda s, p: int(tables[s, p // bs]) * bs + p % bs  # noqa: E731
    # every sequence's last accepted row is at its own position, with its own input
    for s, (c, a) in enumerate(zip(context_lens, accepted)):
        assert int(last_rows[s]) == s * 5 + a
        for j in range(a + 1):
            assert int(positions.reshape(-1)[s * 5 + j]) == c + j
            assert int(token_ids.reshape(-1)[s * 5 + j]) == int(sampled[s, j])
            assert cache[slot_of(s, c + j)] == s * 5 + j, (s, j)
    # rows given another row's input (prepare_inputs' -1: the last row) wrote either past the
    # sequence's last accepted position (rewritten by the next draft steps and verify steps
    # before any query reads it) or, on the port, to the pad block
    foreign = [(s, j) for s in range(3) for j in range(5) if cache[int(metadata.slot_mapping.reshape(-1)[s * 5 + j])]
               != s * 5 + j]
    assert {(s, j) for s, j in foreign if j <= accepted[s]} == set()
    overwritten = {(s, p) for slot, s, p in cached_keys(tables, context_lens, bs) if cache[slot] != -1.0}
    if not tree.port:
        # vllm-gaudi: the padding rows of sequences 1 and 2 write the drafter's K over their
        # position 0, and sequence 0's with it (sequence 1's first block is sequence 0's)
        assert overwritten == {(0, 0), (1, 0), (2, 0)}
        return
    assert overwritten == set()
    pad = range(NUM_KV_BLOCKS * bs, (NUM_KV_BLOCKS + 1) * bs)
    for s, j in foreign:
        slot = int(metadata.slot_mapping.reshape(-1)[s * 5 + j])
        assert slot in pad or (j > accepted[s] and j < num_tokens[s]), (s, j, slot)


# ------------------------------------------------------------- the later draft steps

def later_step(tree, *, bs, max_model_len, context, model_type="beam", num_seq=2, batch=3):
    """prepare_attn_metadata of a later draft step: sequences at positions `context` (one row
    each), padded to `batch` rows; tables of max_model_len / bs columns, as vLLM's input batch."""
    width = -(-max_model_len // bs)
    tables = torch.stack([torch.arange(10 * (s + 1), 10 * (s + 1) + width, dtype=torch.int32) for s in range(num_seq)])
    positions = torch.tensor(list(context) + [0] * (batch - num_seq), dtype=torch.int64)
    drafter = proposer(tree, max_model_len=max_model_len, num_speculative_tokens=4)
    return tables, drafter.prepare_attn_metadata(tables, positions, draft_runner(tree, bs, model_type))


@pytest.mark.parametrize("bs", [4, 16])
def test_later_draft_steps_attend_and_write_each_sequences_own_position(tree, bs):
    max_model_len = 40 * bs
    context = [3 * bs - 1, 5 * bs]  # the last slot of a block, the first of the next
    tables, meta = later_step(tree, bs=bs, max_model_len=max_model_len, context=context)
    slots = meta.slot_mapping.reshape(-1).tolist()
    for s, p in enumerate(context):
        assert slots[s] == int(tables[s, p // bs]) * bs + p % bs
    # each row attends its blocks through the one holding its position, the last filled to it
    blocks, groups, usage = meta.block_list.tolist(), meta.block_groups.tolist(), meta.block_usage.tolist()
    for s, p in enumerate(context):
        mine = [(b, u) for b, g, u in zip(blocks, groups, usage) if g == s]
        assert [b for b, _ in mine] == tables[s, :p // bs + 1].tolist()
        assert [u for _, u in mine] == [bs] * (p // bs) + [p % bs + 1]
    assert all(NUM_KV_BLOCKS * bs <= x < (NUM_KV_BLOCKS + 1) * bs for x in slots[2:])


@pytest.mark.parametrize("bs", [4, 16])
def test_a_draft_step_past_max_model_len_neither_stops_nor_writes_position_0(tree, bs):
    # max_model_len a multiple of the block size, as the recipe's 262144 with blocks of 128: the
    # request that ends there verified its last token at max_model_len - 2, so with k >= 3 its
    # second later draft step is at max_model_len
    max_model_len = 8 * bs
    context = [max_model_len, 3 * bs + 1]
    if not tree.port:
        with pytest.raises(AssertionError):  # `assert len(seq_block_table) == n`: the engine stops
            later_step(tree, bs=bs, max_model_len=max_model_len, context=context)
        # off a block multiple the step runs, and writes over the sequence's position 0
        tables, meta = later_step(tree, bs=bs, max_model_len=max_model_len + 1, context=[max_model_len + 1, 7])
        assert int(meta.slot_mapping.reshape(-1)[0]) == int(tables[0, 0]) * bs
        return
    for mml in (max_model_len, max_model_len + 1):
        tables, meta = later_step(tree, bs=bs, max_model_len=mml, context=[mml + 1, 3 * bs + 1])
        slots = meta.slot_mapping.reshape(-1).tolist()
        assert NUM_KV_BLOCKS * bs <= slots[0] < (NUM_KV_BLOCKS + 1) * bs  # the pad block
        assert slots[1] == int(tables[1, 3]) * bs + 1  # the other sequence: its own position
        assert len(set(slots)) == 3  # the pad slots stay distinct (the proposer's cycle)
        mine = [b for b, g in zip(meta.block_list.tolist(), meta.block_groups.tolist()) if g == 0]
        assert mine == [int(tables[0, 0])]  # the ended row attends its first block only
    # the step at max_model_len itself
    tables, meta = later_step(tree, bs=bs, max_model_len=max_model_len, context=context)
    assert NUM_KV_BLOCKS * bs <= int(meta.slot_mapping.reshape(-1)[0]) < (NUM_KV_BLOCKS + 1) * bs


def test_other_models_keep_vllm_gaudis_draft_step_metadata(tree):
    bs = 4
    tables, meta = later_step(tree, bs=bs, max_model_len=8 * bs + 1, context=[8 * bs + 1, 7], model_type="llama")
    assert int(meta.slot_mapping.reshape(-1)[0]) == int(tables[0, 0]) * bs  # position 0's slot, as stock
