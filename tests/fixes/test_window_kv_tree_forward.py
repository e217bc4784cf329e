"""The consumer side of per-group metadata on the vllm-gaudi tree named by GAUDI_FIXES_ROOT
(skipped without it): a step's GroupedMetadata through the tree's own
HPUModelRunner._execute_model_generic (_seq_len, _num_blocks, _check_config, _use_graphs),
trim_attn_metadata, HpuModelAdapter.forward and HPUAttentionMetadataProcessor.process_metadata /
_set_block_mapping, into vLLM's real forward context, where the tree's own
patched_attention_forward (ops/hpu_attention.py) picks each layer's metadata.

The groups and their tables are vLLM's KVCacheManager's for Beam's 52 layers under a window-sized
cache, each group's decode metadata built by the tree's _create_decode_input_data and its keys
written by the tree's cache write (test_window_kv_tree_decode.Cluster). Every layer's attention
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

import ast
import collections
import contextlib
import logging
import math
from types import SimpleNamespace

import pytest
import torch
from gaudi_source import load
from test_fixes_gaudi import copy_tree, pytestmark  # noqa: F401  (skip without GAUDI_FIXES_ROOT)
from test_port_patches import PROCESSOR_CLS, RUNNER_CLS, apply, gaudi_units
from test_window_kv_tree_decode import BS, NUM_BLOCKS, WINDOW, Cluster

from beam_hpu.runtime.window_kv import groups as wkv
from tests.support.hpu_graph_hash import bridge_hash, bridge_tensors
from fixes.engine import EXIT_OK
from fixes.profile import load_profile
from test_port_patches import PORT_PROFILE  # noqa: E402

UNIT = "beam-window-kv-metadata"
RUNNER = "vllm_gaudi/v1/worker/hpu_model_runner.py"


def dataclass_fields(root) -> list[str]:
    """The field names of the tree's HPUAttentionMetadata and HPUAttentionMetadataV1."""
    names = []
    for path, cls in (("vllm_gaudi/attention/backends/hpu_attn.py", "HPUAttentionMetadata"),
                      ("vllm_gaudi/v1/attention/backends/hpu_attn.py", "HPUAttentionMetadataV1")):
        module = ast.parse((root / path).read_text())
        node = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == cls)
        names += [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)]
    # HPUPagedAttentionMetadata's fields (the base of both)
    return list(dict.fromkeys(names + ["block_list", "block_mapping", "block_usage", "block_groups",
                                       "alibi_blocks"]))


class TreeRun:
    """The tree's runner, adapter and processor functions, bound to small records of their state."""

    def __init__(self, root, vllm_config):
        runner = root / "vllm_gaudi/v1/worker/hpu_model_runner.py"
        self.root, self.vllm_config = root, vllm_config
        type_cache: dict = {}
        subtuple = load(runner, "subtuple", collections=collections, _TYPE_CACHE=type_cache, Optional=None)
        replace = load(runner, "custom_tuple_replace", _TYPE_CACHE=type_cache)
        self.trim = load(runner, "trim_attn_metadata", subtuple=subtuple, HPUAttentionMetadataV1=None)
        mapping = load(runner, "_set_block_mapping", PROCESSOR_CLS, torch=torch, math=math,
                       is_fake_hpu=lambda: True, custom_tuple_replace=replace)
        process = load(runner, "process_metadata", PROCESSOR_CLS)
        self.processed = []  # (the metadata process_metadata was given, what it returned)
        # FusedSDPA prompts (the recipe's), window SDPA off: the prompt masks come from the block lists.
        processor = SimpleNamespace(interleaved_sliding_window=True, sliding_window=WINDOW, block_size=BS,
                                    prefill_use_fusedsdpa=True, use_window_sdpa=False, slice_size=1024,
                                    slice_thld=8192, vllm_config=SimpleNamespace(model_config=SimpleNamespace(
                                        hf_config=SimpleNamespace(model_type="beam"))))
        processor._set_block_mapping = lambda *a, **k: mapping(processor, *a, **k)
        for name in ("_set_attn_bias", "_set_attn_bias_for_sliding_window"):
            fn = load(runner, name, PROCESSOR_CLS, torch=torch, math=math, custom_tuple_replace=replace)
            setattr(processor, name, (lambda f: lambda *a, **k: f(processor, *a, **k))(fn))
        self.process_alone = lambda md, *args: process(processor, md, *args)

        def recorded_process(md, *args):
            out = process(processor, md, *args)
            self.processed.append((md, out))
            return out

        self.processor = SimpleNamespace(process_metadata=recorded_process)
        self.marked = []
        from vllm.forward_context import get_forward_context, set_forward_context

        no_lora = SimpleNamespace(setLoraMask=lambda m: None)
        adapter_forward = load(runner, "forward", "HpuModelAdapter", LoraMask=no_lora,
                               set_forward_context=set_forward_context,
                               set_hpu_dp_metadata=lambda *a: contextlib.nullcontext(),
                               _mark_unbacked_dim0=self.marked.append)
        attention = load(root / "vllm_gaudi/ops/hpu_attention.py", "patched_attention_forward",
                         get_forward_context=get_forward_context, torch=torch)
        self.seen = {}  # layer name -> the metadata its attention was handed
        self.model = SimpleNamespace()
        self.hashes = []

        def model(input_ids, positions, inputs_embeds=None):
            for layer in self.layers:
                attention(layer, input_ids, input_ids, input_ids)
            return torch.zeros(input_ids.numel(), 4)

        self.adapter = SimpleNamespace(metadata_processor=self.processor, pooling_model=False, flatten_input=True,
                                       dtype=torch.float32, _rotary_prepare_cos_sin=None, vllm_config=vllm_config,
                                       dummy_num_input_tokens=-1, dummy_num_tokens_across_dp_cpu=None, model=model)

        def graph_wrapper(*args, **kwargs):  # what wrap_in_hpu_graph does before it calls forward
            kwargs.pop("bypass_hpu_graphs", False)
            self.hashes.append((bridge_hash((args, kwargs)), bridge_tensors(kwargs["attn_metadata"])))
            return adapter_forward(self.adapter, *args, **kwargs)

        self.runner = SimpleNamespace(seen_configs=set(), debug_fwd=None, model_has_chunked_attention=False,
                                      is_driver_worker=True, use_aux_hidden_state_outputs=False,
                                      model_config=SimpleNamespace(enforce_eager=False),
                                      max_cudagraph_capture_size=8192,
                                      profiler=SimpleNamespace(record_event=lambda *a: contextlib.nullcontext()),
                                      model=SimpleNamespace(forward=graph_wrapper, compute_logits=lambda h: h))
        for name in ("_seq_len", "_num_blocks", "_check_config", "_use_graphs"):
            fn = load(runner, name, RUNNER_CLS, logger=logging.getLogger("gaudi_tree"))
            setattr(self.runner, name, (lambda f: lambda *a, **k: f(self.runner, *a, **k))(fn))
        self.execute = load(runner, "_execute_model_generic", RUNNER_CLS, trim_attn_metadata=self.trim,
                            htorch=SimpleNamespace(utils=SimpleNamespace(internal=SimpleNamespace(
                                is_lazy=lambda: True))), LoraMask=no_lora)
        self.record_cls = metadata_record(dataclass_fields(root), load(
            root / "vllm_gaudi/v1/attention/backends/hpu_attn.py", "seq_len", "HPUAttentionMetadataV1"), load(
            root / "vllm_gaudi/v1/attention/backends/hpu_attn.py", "num_blocks", "HPUAttentionMetadataV1"))

    def use_layers(self, names_and_windows):
        self.layers = [SimpleNamespace(layer_name=name, use_direct_call=True, query_quant=None, kv_cache=None,
                                       attn_backend=SimpleNamespace(forward_includes_kv_cache_update=True),
                                       impl=SimpleNamespace(forward=self._recorder(name)), sliding_window=w)
                       for name, w in names_and_windows]

    def _recorder(self, name):
        def forward(layer, query, key, value, kv_cache, attn_metadata):
            self.seen[name] = attn_metadata
            return query
        return forward

    def run_step(self, metadata, rows: int):
        self.seen.clear()
        token_ids = torch.zeros((rows, 1), dtype=torch.int32)
        return self.execute(self.runner, token_ids, token_ids.clone(), metadata, torch.arange(rows), None, None, None)


def metadata_record(fields, seq_len, num_blocks):
    """The tree's HPUAttentionMetadataV1 as a plain record: every field (None unless given), and
    its own seq_len / num_blocks."""
    def init(self, **values):
        unknown = set(values) - set(fields)
        assert not unknown, unknown
        for f in fields:
            setattr(self, f, values.get(f))
    return type("HPUAttentionMetadataV1Record", (), {"__init__": init, "seq_len": seq_len, "num_blocks": num_blocks})


class CapturingCluster(Cluster):
    """Cluster whose steps keep each group's decode metadata (the tree's own) for the forward."""

    def step(self, seqs, num_tokens):
        self.captured = []
        return super().step(seqs, num_tokens)

    def check_reads(self, names, window, meta, *args):
        self.captured.append(meta)
        return super().check_reads(names, window, meta, *args)


def keys_read(cluster, name, md, sliding: bool, rows: int) -> list[list[int]]:
    """The key codes the layer's decode attention reads per row from its processed metadata."""
    cache = cluster.caches[cluster.buffer_of[name]]
    blocks = md.window_block_list if sliding else md.block_list
    groups = md.window_block_groups if sliding else md.block_groups
    bias = md.window_attn_bias if sliding else md.attn_bias
    got = [[] for _ in range(rows)]
    for i, (bid, row) in enumerate(zip(blocks.tolist(), groups.tolist())):
        if 0 <= row < rows:
            got[row] += [int(cache[bid * BS + o]) for o in range(BS) if bias[i, o] == 0]
    return got


def port_tree(tmp_path, with_unit: bool) -> SimpleNamespace:
    """A copy of the tree with the port profile's vllm-gaudi units, with or without this one
    (without it: the port as it was, beam-exact-window's per-table windows included)."""
    root, checkouts = copy_tree(tmp_path / ("with" if with_unit else "without"))
    only = [n for n in gaudi_units(load_profile(PORT_PROFILE)) if with_unit or n != UNIT]
    report = apply(root, checkouts, only=only)
    assert report.exit_code == EXIT_OK, report.lines
    return SimpleNamespace(root=root, port=with_unit, runner=root / RUNNER)


@pytest.fixture(params=[f"port without {UNIT}", "port"])
def tree(request, tmp_path):
    return port_tree(tmp_path, request.param == "port")


@pytest.fixture(scope="module")
def vllm_config():
    from tests.runtime.window_kv.test_groups_vllm import vllm_config as make

    return make()


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
                got = keys_read(cluster, name, run.seen[name], sliding, rows)
                for s, c in enumerate(context_lens):
                    q = c
                    lo = 0 if not sliding else max(0, q - WINDOW + 1)
                    want = sorted(int(cluster.code(name, seqs[s].tokens, p)) for p in range(lo, q + 1))
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
    other = wkv.GroupedMetadata([run.record_cls(**{f: (v.clone().fill_(0) if torch.is_tensor(v) else v)
                                                   for f, v in vars(g).items()}) for g in md.groups],
                                md.group_layer_names, md.primary)
    run.run_step(other, md.slot_mapping.numel())
    assert run.hashes[0][0] == run.hashes[1][0]  # other values, the same shapes: the same graph


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
        context = wkv.group_prefill_context([tables[gid]], [ctx], wkv.GroupGeometry(window), BS)[0]
        slots = wkv.group_slots(tables[gid], range(ctx, ctx + chunk), BS)
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
