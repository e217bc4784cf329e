"""The consumer side of per-group metadata on the vllm-gaudi tree named by GAUDI_FIXES_ROOT
(skipped without it): a step's GroupedMetadata through the tree's own
HPUModelRunner._execute_model_generic (_seq_len, _num_blocks, _check_config, _use_graphs),
trim_attn_metadata, HpuModelAdapter.forward and HPUAttentionMetadataProcessor.process_metadata /
_set_block_mapping, into vLLM's real forward context, where the tree's own
patched_attention_forward (ops/hpu_attention.py) picks each layer's metadata.

The groups and their tables are vLLM's KVCacheManager's for Beam's 52 layers under a window-sized
cache, each group's decode metadata built by the tree's _create_decode_input_data and its keys
written by the tree's cache write (tests/support/gaudi/window_kv_decode.py). Every layer's attention
records the processed metadata it is handed; the keys that metadata makes it read (its block list,
block groups and bias: the window ones in sliding layers, as hpu_attn.py's decode branch picks
them) must be exactly the definition's. Between the trim and the forward sits a stand-in for the
HPU graph wrapper: it hashes the inputs by the PT bridge's rule (tuples by element, tensors by
shape, the rest by value) and pops bypass_hpu_graphs, as the wrapper does.

Without this unit (the port's other units, beam-exact-window included, applied), the stock trim
keeps only the primary group's fields and every layer reads the full group's blocks: the sliding
layers read wrong keys. A plain metadata takes the stock path: with and without the unit, the
same calls, records, warm-up key and graph hash.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from beam_hpu.runtime.window_kv import groups as wkv
from tests.support.gaudi.tree import port_tree as patched_tree
from tests.support.gaudi.window_kv_decode import BS, WINDOW, Cluster
from tests.support.gaudi.window_kv_forward import TreeRun
from tests.support.hpu_graph_hash import bridge_tensors, replay_mismatches
from tests.support.window_kv.configs import vllm_config as make_vllm_config
from tests.support.window_kv.oracles import GroupGeometry, group_prefill_context, group_slots, keys_read, window_positions

pytestmark = pytest.mark.gaudi_tree
UNIT = "beam-window-kv-metadata"


class CapturingCluster(Cluster):
    """Cluster whose steps keep each group's decode metadata (the tree's own) for the forward."""

    def step(self, seqs, num_tokens):
        self.captured = []
        return super().step(seqs, num_tokens)

    def check_reads(self, names, window, meta, *args):
        self.captured.append(meta)
        return super().check_reads(names, window, meta, *args)


def port_tree(tmp_path, with_unit: bool) -> SimpleNamespace:
    """A copy of the tree with the port profile's vllm-gaudi units, with or without this one
    (without it: the port as it was, beam-exact-window's per-table windows included)."""
    return patched_tree(tmp_path / ("with" if with_unit else "without"), without=() if with_unit else (UNIT, ))


@pytest.fixture(params=[f"port without {UNIT}", "port"])
def tree(request, tmp_path):
    return port_tree(tmp_path, request.param == "port")


@pytest.fixture(scope="module")
def vllm_config():
    return make_vllm_config()


def grouped_step(cluster, run, seqs):
    """One decode step of every sequence: each group's metadata from the tree, as a GroupedMetadata."""
    cluster.commit(seqs, cluster.step(seqs, [1] * len(seqs)))
    records = [run.record_cls(is_prompt=False, **vars(meta)) for meta in cluster.captured]
    return wkv.GroupedMetadata(records, cluster.groups, wkv.primary_group(cluster.windows))


def test_each_layer_reads_its_own_groups_processed_metadata(tree, vllm_config):
    cluster = CapturingCluster(tree, seed=1)
    run = TreeRun(tree.root, vllm_config)
    run.use_layers([(n, w) for names, w in zip(cluster.groups, cluster.windows) for n in names])
    rng = cluster.rng
    seqs = [cluster.admit(f"r{i}", [rng.randrange(1000) for _ in range(rng.randrange(9, 30))]) for i in range(3)]
    for seq in seqs:
        seq.tokens.append(rng.randrange(1000))
        seq.req.append_output_token_ids(seq.tokens[-1])
    mismatches = checked = 0
    for _ in range(6):
        context_lens = [len(s.tokens) - 1 for s in seqs]  # before the step commits its token
        md = grouped_step(cluster, run, seqs)
        rows = md.slot_mapping.numel()
        run.processed.clear()
        run.run_step(md, rows)
        assert set(run.seen) == set(md)  # every layer's attention ran
        primary = md.groups[md.primary]
        if not tree.port:  # the stock trim keeps the primary's fields: one processing, one record for all
            assert len(run.processed) == 1 and len({id(m) for m in run.seen.values()}) == 1
        else:
            # process_metadata ran once per group, each time on that group's trimmed metadata
            assert [p[0].block_list for p in run.processed] == [g.block_list for g in md.groups]
            processed_of = [out for _, out in run.processed]
            for gid, names in enumerate(cluster.groups):
                for name in names:
                    assert run.seen[name] is processed_of[gid]
                    assert torch.equal(run.seen[name].block_list, md.groups[gid].block_list)
            # The graph input: each group's tensors once, hashed by shape only.
            h, listed = run.hashes[-1]
            trimmed = [run.trim(g) for g in md.groups]
            assert len(listed) == sum(len(bridge_tensors(t)) for t in trimmed)
        for gid, names in enumerate(cluster.groups):
            sliding = cluster.windows[gid] is not None
            for name in names:
                seen = run.seen[name]
                got = keys_read(cluster.cache(name), (seen.window_block_list if sliding else seen.block_list).tolist(),
                                (seen.window_block_groups if sliding else seen.block_groups).tolist(),
                                seen.window_attn_bias if sliding else seen.attn_bias, rows, BS)
                for s, q in enumerate(context_lens):
                    want = sorted(int(cluster.code(name, seqs[s].tokens, p))
                                  for p in window_positions(q, WINDOW if sliding else None))
                    checked += 1
                    mismatches += sorted(got[s]) != want
        # The step-wide view and the warm-up key.
        cfg = ("decode", rows, 1, primary.block_list.numel())
        want_cfg = cfg + (tuple((g.block_list.numel(), g.window_block_list.numel()) for g in md.groups), ) \
            if tree.port else cfg
        assert want_cfg in run.runner.seen_configs
    assert checked == 6 * 3 * 52
    assert cluster.mismatches == 0  # the per-group builds themselves (Cluster's own check)
    if tree.port:
        assert mismatches == 0
    else:
        assert mismatches > 0  # sliding layers read the full group's blocks


def test_graph_key_of_grouped_metadata_does_not_depend_on_values(vllm_config, tmp_path):
    tree = port_tree(tmp_path, with_unit=True)
    cluster = CapturingCluster(tree, seed=2)
    run = TreeRun(tree.root, vllm_config)
    run.use_layers([(n, w) for names, w in zip(cluster.groups, cluster.windows) for n in names])
    seqs = [cluster.admit("r0", list(range(20)))]
    seqs[0].tokens.append(7)
    seqs[0].req.append_output_token_ids(7)
    md = grouped_step(cluster, run, seqs)
    run.run_step(md, md.slot_mapping.numel())
    other = wkv.GroupedMetadata([run.record_cls(**{f: (zeros_like_view(v) if torch.is_tensor(v) else v)
                                                   for f, v in vars(g).items()}) for g in md.groups],
                                md.group_layer_names, md.primary)
    run.run_step(other, md.slot_mapping.numel())
    assert run.hashes[0][0] == run.hashes[1][0]  # other values, the same shapes: the same graph
    assert replay_mismatches(run.replay_inputs[0], run.replay_inputs[1]) == []  # and it binds them alike


def zeros_like_view(tensor: torch.Tensor) -> torch.Tensor:
    """Zeros laid out as `tensor` is, a view of a same-shaped base where it is one: the next step's
    metadata, built the same way with other values (the graph key hashes views too)."""
    if tensor._base is None:
        return torch.zeros_like(tensor)
    return torch.zeros_like(tensor._base).as_strided(tensor.size(), tensor.stride(), tensor.storage_offset())


def test_plain_metadata_takes_the_stock_path(vllm_config, tmp_path):
    """One plain metadata (the switch off, or another model) through the port's tree with and
    without this unit: the same calls, the same processed record in every layer, the same warm-up
    key and graph hash."""
    results = []
    for with_unit in (False, True):
        tree = port_tree(tmp_path, with_unit)
        cluster = CapturingCluster(tree, seed=3)
        run = TreeRun(tree.root, vllm_config)
        names = [n for names in cluster.groups for n in names]
        run.use_layers([(n, WINDOW) for n in names])
        seqs = [cluster.admit(f"r{i}", list(range(5 + 7 * i))) for i in range(2)]
        for seq in seqs:
            seq.tokens.append(1)
            seq.req.append_output_token_ids(1)
        cluster.step(seqs, [1, 1])
        plain = run.record_cls(is_prompt=False, **vars(cluster.captured[0]))
        run.run_step(plain, plain.slot_mapping.numel())
        assert len(run.processed) == 1 and len({id(m) for m in run.seen.values()}) == 1
        seen = run.seen[names[0]]
        assert not isinstance(seen, dict) and type(seen).__name__ == "TrimmedAttentionMetadata"
        results.append((seen, run.runner.seen_configs, run.hashes[0][0], len(run.hashes[0][1])))
    (a, cfg_a, h_a, n_a), (b, cfg_b, h_b, n_b) = results
    assert cfg_a == cfg_b and h_a == h_b and n_a == n_b
    assert a._fields == b._fields
    for field in a._fields:
        x, y = getattr(a, field), getattr(b, field)
        assert (torch.equal(x, y) if torch.is_tensor(x) else x == y), field


def test_prompt_groups_are_processed_and_marked_each_from_their_own_context(tree, vllm_config):
    """A prefill chunk after cached context: each group's context blocks (the whole context in the
    full group, the window-trimmed context in sliding groups, from vLLM's manager's tables) get
    their own prompt masks, every group's block list is marked unbacked, and each layer's
    attention gets its group's: the same record the processor makes of that group alone."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    cluster = Cluster(tree, seed=4)
    run = TreeRun(tree.root, vllm_config)
    run.use_layers([(n, w) for names, w in zip(cluster.groups, cluster.windows) for n in names])
    ctx, chunk = 30, 6
    req = Request("p0", list(range(ctx + chunk)), SamplingParams(max_tokens=4), None)
    assert cluster.manager.allocate_slots(req, ctx) is not None
    req.num_computed_tokens = ctx
    assert cluster.manager.allocate_slots(req, chunk) is not None
    tables = cluster.manager.get_block_ids("p0")
    records = []
    for gid, window in enumerate(cluster.windows):
        context = group_prefill_context([tables[gid]], [ctx], GroupGeometry(window), BS)[0]
        slots = group_slots(tables[gid], range(ctx, ctx + chunk), BS)
        blocks = torch.tensor(context, dtype=torch.long)
        records.append(run.record_cls(is_prompt=True, block_size=BS, block_list=blocks,
                                      window_block_list=None if window is None else blocks,
                                      context_lens_tensor=torch.tensor([ctx]), seq_lens_tensor=torch.tensor([chunk]),
                                      slot_mapping=torch.tensor([slots])))
    md = wkv.GroupedMetadata(records, cluster.groups, wkv.primary_group(cluster.windows))
    assert len({r.block_list.numel() for r in records}) == 2  # the full context and the window's
    token_ids = torch.zeros((1, chunk), dtype=torch.int32)
    run.execute(run.runner, token_ids, token_ids.clone(), md, torch.tensor([chunk - 1]), None, None, None)
    if not tree.port:  # one processing, the primary's block list marked, every layer the primary's
        assert len(run.processed) == 1 and [id(t) for t in run.marked] == [id(md.groups[md.primary].block_list)]
        sliding = next(n for names, w in zip(cluster.groups, cluster.windows) if w for n in names)
        assert run.seen[sliding].block_list.numel() != records[cluster.groups.index(
            next(g for g in cluster.groups if sliding in g))].block_list.numel()
        return
    assert [id(t) for t in run.marked] == [id(r.block_list) for r in records]
    assert len(run.processed) == len(records)
    for gid, names in enumerate(cluster.groups):
        alone = run.process_alone(run.trim(records[gid]), 1, chunk, "cpu", torch.float32, False)
        for name in names:
            seen = run.seen[name]
            for field in ("attn_bias", "window_attn_bias", "block_list"):
                a, b = getattr(seen, field), getattr(alone, field)
                assert (a is None and b is None) or torch.equal(a, b), (name, field)
        # The masks span this group's own context: its blocks, then the chunk.
        bias = run.seen[names[0]].window_attn_bias if cluster.windows[gid] else run.seen[names[0]].attn_bias
        assert bias.shape[-1] == records[gid].block_list.numel() * BS + chunk
