"""The port's three window-KV units together on the vllm-gaudi tree named by GAUDI_FIXES_ROOT
(skipped without it), step after step, with the whole port profile applied.

One runner object (tests/support/gaudi/window_kv_runner.py's make_runner: the tree's own step
methods) is given:
- its KV caches by the tree's own get_kv_cache_spec and initialize_kv_cache (beam-window-kv-cache:
  9 shared buffers + the pad block, bound to Beam's 52 real vLLM Attention layers, one block table
  per group in the tree's InputBatch, which holds each step's rows);
- its steps by the tree's own _prepare_inputs (beam-window-kv-steps) over vLLM's KVCacheManager,
  prefix caching on, a pool small enough that blocks are freed and reused (Steps' scheduler:
  prefix hits, chunked prefill, decodes, verify rows, requests finishing and admitted);
- its forward by the tree's own _execute_model_generic -> trim_attn_metadata ->
  HpuModelAdapter.forward -> process_metadata -> patched_attention_forward's pick
  (beam-window-kv-metadata), into 52 layers whose attention writes its keys with the tree's
  VLLMKVCache.forward into the buffer bound to the layer, at the slots of the metadata it was
  handed, and reads them back through that metadata's block lists, block groups and masks.

Every key each query attends must be the exact-window definition's (window W: i - W < j <= i;
full layers everything), written by that layer for that sequence. With one unit left out the
same run errors or mismatches; with the switch off the port's tree takes the stock path.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from beam_hpu.runtime.window_kv import groups as wkv
from tests.support.gaudi.source import RUNNER, load
from tests.support.gaudi.tree import port_tree
from tests.support.gaudi.window_kv_cache import (beam_vllm_config, kv_cache_config, kv_cache_specs, runner_for_kv_init,
                                                 runner_module_globals, stock_allocation_fails_on_shared_by)
from tests.support.gaudi.window_kv_forward import TreeRun
from tests.support.gaudi.window_kv_runner import make_runner, set_batch
from tests.support.gaudi.window_kv_steps import BS, WIDTH, WINDOW, Steps
from tests.support.window_kv.oracles import keys_read, window_positions

pytestmark = pytest.mark.gaudi_tree
POOL = 160  # blocks: 4 sequences of up to ~75 tokens fill it, so freed blocks come back
UNITS = ("beam-window-kv-cache", "beam-window-kv-steps", "beam-window-kv-metadata")


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """The port's tree, and the port's tree without one of the three units, made on first use."""
    made = {}

    def tree(*without: str):
        if without not in made:
            made[without] = port_tree(tmp_path_factory.mktemp("-".join(without) or "port") / "site", without=without)
        return made[without]
    return tree


@pytest.fixture(scope="module")
def beam_config():
    return beam_vllm_config(BS, WINDOW)


class Served(Steps):
    """Steps' scheduler over one runner that allocates, builds and runs every step itself."""

    def __init__(self, tree, config, seed: int, model_type: str = "beam", merged: bool = False, kc=None):
        globals_ = runner_module_globals(tree.runner)
        specs = kv_cache_specs(tree, config, model_type, globals_, dtype=torch.float32)  # codes exact to 2**24
        kc = kc or kv_cache_config(config, specs, POOL)
        runner = make_runner(tree.runner, kc, block_size=BS, window=WINDOW, num_kv_blocks=kc.num_blocks,
                             merged_prefill=merged, model_type=model_type)
        runner.max_num_reqs = 8
        runner.model_config = SimpleNamespace(dtype=torch.float32, use_mla=False, get_vocab_size=lambda: 64,
                                              enforce_eager=False)
        _, initialize = runner_for_kv_init(tree, config, globals_, into=runner, block_size=BS)
        self.forward_context = config.compilation_config.static_forward_context
        self.window_kv = len(kc.kv_cache_groups) > 1
        if self.window_kv:
            initialize(runner, kc)
        else:  # the stock allocation on vLLM 0.30 fails (test_tree_cache.py): one buffer a layer
            with stock_allocation_fails_on_shared_by():
                initialize(runner, kc)
            shape = ((kc.num_blocks + 1) * BS, 1, 16)
            for name in self.forward_context:
                self.forward_context[name].kv_cache = (torch.zeros(shape), torch.zeros(shape), None, None)
            runner.kv_caches = [self.forward_context[n].kv_cache for n in self.forward_context]
        assert runner._PAD_BLOCK_ID == kc.num_blocks
        self.block_table = runner.input_batch.block_table  # the tree's InputBatch's, one table per group
        super().__init__([tree, tree], seed, window_kv=self.window_kv, kc=kc, runner=runner, merged=merged)
        self.run = TreeRun(tree.root, config)
        self.run.use_layers([(n, self.forward_context[n].sliding_window) for n in self.forward_context])
        for layer in self.run.layers:
            layer.kv_cache = self.forward_context[layer.layer_name].kv_cache
            layer.impl.forward = self.attention(layer.layer_name)
        self.write_kv = load(tree.root / "vllm_gaudi/extension/utils.py", "forward", "VLLMKVCache")
        self.serve_forward(runner)
        self.values: dict[str, torch.Tensor] = {}
        self.seen: dict[str, object] = {}
        self.warm_up = False
        # beam-exact-window gives exact windows for Beam only; another model's sliding layers read
        # the stock vllm-gaudi window, not this oracle's
        self.check_sliding = model_type == "beam"
        self.grouped_steps = self.plain_steps = 0
        self.live_decodes: list[tuple] = []  # (context lengths, the warm-up key the step was run under)

    def serve_forward(self, runner) -> None:
        """The forward half of the runner: TreeRun's records and the tree's runner methods on it."""
        for name in ("_seq_len", "_num_blocks", "_check_config", "_use_graphs"):
            fn = load(self.run.root / RUNNER, name, "HPUModelRunner", logger=logging.getLogger("gaudi_tree"))
            setattr(runner, name, (lambda f: lambda *a, **k: f(runner, *a, **k))(fn))
        for name in ("seen_configs", "debug_fwd", "is_driver_worker", "use_aux_hidden_state_outputs",
                     "max_cudagraph_capture_size", "model"):
            setattr(runner, name, getattr(self.run.runner, name))
        runner.profiler.record_event = self.run.runner.profiler.record_event
        runner.debug_fwd = lambda cfg: setattr(self, "last_cfg", cfg)  # the tree hands it each step's key

    def attention(self, name: str):
        def forward(layer, query, key, value, kv_cache, attn_metadata):
            self.seen[name] = attn_metadata
            slots = attn_metadata.slot_mapping.flatten()
            real = slots >= 0  # prefill padding slots are -1: written nowhere
            if not self.warm_up:  # vLLM's null block (0) is never a live row's, in any group
                assert not (slots[real] // BS == wkv.NULL_BLOCK_ID).any(), name
            keys = self.values[name][real].view(-1, 1, 1).expand(-1, *kv_cache[0].shape[1:]).contiguous()
            self.write_kv(None, keys, kv_cache[0], slots[real])
            self.write_kv(None, keys, kv_cache[1], slots[real])
            return query
        return forward

    def cache_of(self, name: str) -> torch.Tensor:
        """The keys of the buffer the layer is bound to (its tuple's K), one code a slot."""
        return self.forward_context[name].kv_cache[0][:, 0, 0]

    def execute(self, md, token_ids, position_ids, logits_indices) -> None:
        to_record = lambda m: self.run.record_cls(**vars(m))  # noqa: E731  (the tree's dataclass's fields)
        grouped = isinstance(md, wkv.GroupedMetadata)
        md = md.map_groups(to_record) if grouped else to_record(md)
        self.grouped_steps += grouped
        self.plain_steps += not grouped
        self.seen.clear()
        self.run.execute(self.runner, token_ids, position_ids, md, logits_indices, self.runner.kv_caches, None, None,
                         warmup_mode=self.warm_up)
        assert set(self.seen) == set(self.forward_context)  # every layer ran

    def step(self) -> None:
        batch, num_decodes, views, tables, sched = self.plan_step()
        order = [seq for seq, _ in batch]
        set_batch(self.runner, views, tables, WIDTH, block_table=self.block_table)
        self.runner.invalid_req_indices = []
        (prefill, _), (decode, _) = self.runner._prepare_inputs(sched, len(batch) - num_decodes, num_decodes)
        if num_decodes:
            self.decode(decode, order[:num_decodes], [n for _, n in batch[:num_decodes]])
        for i, rids in enumerate(prefill.request_ids):
            self.prefill(prefill, i, [self.find(r) for r in rids])
        self.check_held(batch)
        self.commit(batch)

    # ---- decodes and verify rows

    def decode(self, data, seqs, num_tokens) -> None:
        kind = "verify" if max(num_tokens) > 1 else "decode"
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        per_seq = max(num_tokens)
        rows = data.attn_metadata.slot_mapping.numel()
        self.values = {n: torch.zeros(rows) for n in self.forward_context}
        for s, (seq, n) in enumerate(zip(seqs, num_tokens)):
            for j in range(n):
                for name in self.values:
                    self.values[name][s * per_seq + j] = self.code(name, seq.tokens + seq.drafts, seq.computed + j)
        self.execute(data.attn_metadata, data.token_ids, data.position_ids, data.logits_indices)
        if max(num_tokens) == 1:
            self.live_decodes.append(([seq.computed for seq in seqs], self.last_config()))
        if self.warm_up:
            return
        for name, md in self.seen.items():
            sliding = self.forward_context[name].sliding_window is not None
            blocks = (md.window_block_list if sliding else md.block_list).tolist()
            owners = (md.window_block_groups if sliding else md.block_groups).tolist()
            bias = md.window_attn_bias if sliding else md.attn_bias
            cache = self.cache_of(name)
            got = keys_read(cache, blocks, owners, bias, rows, BS)
            for s, (seq, n) in enumerate(zip(seqs, num_tokens)):
                for j in range(n):
                    self.expect(got[s * per_seq + j], name, seq.tokens + seq.drafts, seq.computed + j, sliding)

    def expect(self, got, name, tokens, q, sliding) -> None:
        if sliding and not self.check_sliding:
            return
        got = [-1 if k is None else k for k in got]  # a masked-in column without a key: a mismatch
        want = [int(self.code(name, tokens, p)) for p in window_positions(q, WINDOW if sliding else None)]
        self.miss(got, want, (name, q))

    # ---- prefill batches (one forward each, as the runner's execute_model runs them)

    def prefill(self, data, i, seqs) -> None:
        md = data.attn_metadata[i]
        one = md.groups[md.primary] if isinstance(md, wkv.GroupedMetadata) else md
        ctx_lens, query_lens = one.context_lens_tensor.tolist(), one.seq_lens_tensor.tolist()
        width = one.slot_mapping.shape[1]
        merged = self.runner.use_merged_prefill
        starts = [sum(query_lens[:b]) if merged else b * width for b in range(len(seqs))]
        self.values = {n: torch.zeros(one.slot_mapping.numel()) for n in self.forward_context}
        for b, seq in enumerate(seqs):
            for j in range(query_lens[b]):
                for name in self.values:
                    self.values[name][starts[b] + j] = self.code(name, seq.tokens, ctx_lens[b] + j)
        kind = ("merged prefill" if merged else "batched prefill") if len(seqs) > 1 else \
            "prefill with context" if ctx_lens[0] else "prefill"
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.execute(md, data.token_ids[i], data.position_ids[i], data.logits_indices[i])
        if self.warm_up:
            return
        for name, seen in self.seen.items():
            sliding = self.forward_context[name].sliding_window is not None
            bias = seen.window_attn_bias if sliding else seen.attn_bias
            blocks = seen.window_block_list if sliding else seen.block_list
            if bias is None:  # no context and no mask: FusedSDPA's causal chunk
                assert blocks is None or not any(ctx_lens), name
                self.kinds["causal chunk"] = self.kinds.get("causal chunk", 0) + 1
                for b, seq in enumerate(seqs):
                    for j in range(query_lens[b]):
                        got = [int(self.values[name][starts[b] + k]) for k in range(j + 1)]
                        self.expect(got, name, seq.tokens, j, sliding)
                continue
            cache = self.cache_of(name)
            rows_of = 1 if merged else len(query_lens)
            per_row = blocks.view(rows_of, -1).tolist() if blocks is not None else [[] for _ in range(rows_of)]
            for b, seq in enumerate(seqs):
                r = 0 if merged else b
                if merged:  # _make_attn_bias's columns: the batch's context blocks, then all its tokens
                    keys = [int(cache[bid * BS + o]) if bid >= 0 else None for row in per_row for bid in row
                            for o in range(BS)] + [int(v) for v in self.values[name]]
                    assert len(keys) == bias.shape[-1], (name, len(keys), bias.shape)
                else:
                    keys = [int(cache[bid * BS + o]) if bid >= 0 else None for bid in per_row[r] for o in range(BS)]
                    keys += [int(v) for v in self.values[name][r * width:(r + 1) * width]]
                for j in range(query_lens[b]):
                    i_row = starts[b] + j if merged else j
                    got = [keys[k] for k in range(len(keys)) if bias[r, 0, i_row, k] == 0]
                    self.expect(got, name, seq.tokens, ctx_lens[b] + j, sliding)

    def last_config(self) -> tuple:
        return self.last_cfg  # the warm-up key _check_config made of the step

    # ---- warm-up

    def warm_up_decodes(self, context_lens: list[int]) -> None:
        """A warm-up decode batch (the tree's _add_dummy_request: block 0 in every column of every
        group's table, as _prepare_dummy_scenario asks without contiguous PA) through the same
        _prepare_inputs and forward, in warm-up mode."""
        requests, scheduled = [], {}
        for n in context_lens:
            self.runner._add_dummy_request(requests, scheduled, n, n, 1, False, block_id=0)
        views = [SimpleNamespace(rid=r.req_id, tokens=list(r.prompt_token_ids), computed=r.num_computed_tokens,
                                 prompt_len=len(r.prompt_token_ids)) for r in requests]
        tables = [[list(r.block_ids[g]) for r in requests] for g in range(len(self.groups))]
        sched = SimpleNamespace(total_num_scheduled_tokens=len(requests), num_scheduled_tokens=scheduled,
                                scheduled_spec_decode_tokens={})
        set_batch(self.runner, views, tables, WIDTH, block_table=self.block_table)
        self.runner.invalid_req_indices = []
        self.warm_up = True
        try:
            (_, _), (decode, _) = self.runner._prepare_inputs(sched, 0, len(requests))
            self.decode(decode, [SimpleNamespace(tokens=v.tokens, drafts=[], computed=v.computed) for v in views],
                        [1] * len(views))
        finally:
            self.warm_up = False


def live_rows(buffers: list[torch.Tensor], num_blocks: int) -> torch.Tensor:
    """The buffers' rows outside vLLM's null block (0) and the pad block (num_blocks)."""
    return torch.stack([b[BS:num_blocks * BS] for b in buffers])


def served_run(tree, config, seed: int, n_steps: int, monkeypatch, switch: str = "1", **kw) -> Served:
    monkeypatch.setenv("BEAM_WINDOW_KV", switch)
    s = Served(tree, config, seed, **kw)
    for _ in range(n_steps):
        s.step()
    return s


def test_three_units_serve_exact_windows_step_after_step(trees, beam_config, monkeypatch):
    s = served_run(trees(), beam_config, 0, 40, monkeypatch)
    assert len(s.groups) == 6 and s.windows.count(WINDOW) == 5
    assert len(wkv.distinct_kv_caches(s.runner.kv_caches)) == 9  # A's nine shared buffers served the run
    assert s.plain_steps == 0 and s.grouped_steps > 40
    assert s.mismatches == 0, s.first_mismatch
    for kind in ("decode", "verify", "prefill with context", "prefix hit", "prefill", "batched prefill"):
        assert s.kinds.get(kind, 0) > 0, s.kinds
    assert s.null_columns > 0 and s.reused > 0, (s.null_columns, s.reused)  # freed window blocks, reused
    assert s.rows_checked > 20000, s.rows_checked


def test_merged_prefill_through_the_three_units(trees, beam_config, monkeypatch):
    """Merged prefill (VLLM_MERGED_PREFILL): the three units add no error to it. What it reads is
    not yet exact on this tree with the switch on or off alike (found here, outside the window-KV
    units): a merged batch's sliding-window bias lets a request's first tokens see the previous
    request's last W-1 tokens, and a prompt with context in merged mode gives full layers other
    keys than its whole context. The same seed gives the same mismatches in both runs."""
    on = served_run(trees(), beam_config, 1, 20, monkeypatch, merged=True)
    off = served_run(trees(), beam_config, 1, 20, monkeypatch, switch="0", merged=True)
    assert len(on.groups) == 6 and len(off.groups) == 1
    assert on.kinds.get("merged prefill", 0) > 0, on.kinds
    assert on.mismatches == off.mismatches and on.first_mismatch == off.first_mismatch
    print("merged prefill on the tree:", on.mismatches, "mismatched reads; first:", on.first_mismatch)
    assert on.mismatches > 0  # why the startup guard refuses VLLM_MERGED_PREFILL for Beam (guards.merged_prefill)


def test_warm_up_decode_writes_no_live_block_and_keys_the_live_step(trees, beam_config, monkeypatch):
    """A warm-up decode batch (block 0 = vLLM's null block in every column of every group) goes
    through the same path without error and writes only block 0 and the pad block; its warm-up key
    is the one a live decode of the same lengths is run under (so no live step goes unwarmed
    for the groups' block lists)."""
    s = served_run(trees(), beam_config, 2, 30, monkeypatch)
    assert s.mismatches == 0, s.first_mismatch
    buffers = [c[part] for c in wkv.distinct_kv_caches(s.runner.kv_caches) for part in (0, 1)]
    before = live_rows(buffers, s.kc.num_blocks).clone()
    lengths, live_key = s.live_decodes[-1]
    s.runner.seen_configs.clear()
    s.warm_up_decodes(lengths)
    assert s.last_config() == live_key and live_key in s.runner.seen_configs
    assert len(live_key[-1]) == 6  # the key holds each group's block-list lengths
    assert torch.equal(live_rows(buffers, s.kc.num_blocks), before)  # no live block touched
    s.step()  # serving goes on over the same buffers, still exact
    assert s.mismatches == 0, s.first_mismatch


@pytest.mark.parametrize("without", ["beam-window-kv-steps", "beam-window-kv-metadata"])
def test_without_one_unit_the_same_run_reads_wrong_keys(trees, beam_config, monkeypatch, without):
    """Cache allocated, but steps built from one group's table (no steps unit), or every layer
    handed the full group's metadata (no metadata unit): sliding or full layers read other keys."""
    s = served_run(trees(without), beam_config, 0, 12, monkeypatch)
    assert len(s.groups) == 6 and len(wkv.distinct_kv_caches(s.runner.kv_caches)) == 9
    if without == "beam-window-kv-steps":  # one plain metadata, built from group 0's table
        assert s.grouped_steps == 0
    assert s.mismatches > 0


def test_without_the_cache_unit_there_are_no_window_groups(trees, beam_config, monkeypatch):
    """No beam-window-kv-cache: the tree gives full specs (one group, no window-sized pool), and the
    window-sized config vLLM would make of the port's specs cannot be allocated (the stock
    allocation reads KVCacheTensor.shared_by, which vLLM 0.30 dropped)."""
    monkeypatch.setenv("BEAM_WINDOW_KV", "1")
    tree = trees("beam-window-kv-cache")
    globals_ = runner_module_globals(tree.runner)
    assert len(kv_cache_config(beam_config, kv_cache_specs(tree, beam_config, "beam", globals_)).kv_cache_groups) == 1
    port_specs = kv_cache_specs(trees(), beam_config, "beam", runner_module_globals(trees().runner),
                                dtype=torch.float32)
    with stock_allocation_fails_on_shared_by():
        Served(tree, beam_config, 0, kc=kv_cache_config(beam_config, port_specs, POOL))


def test_switch_off_takes_the_stock_path_and_reads_full_context(trees, beam_config, monkeypatch):
    """BEAM_WINDOW_KV=0 on the same tree: one full-attention group, plain metadata every step, full
    layers read the whole context and sliding layers their exact window over the full-context
    tables (beam-exact-window), as the port does without the window-KV units."""
    s = served_run(trees(), beam_config, 0, 25, monkeypatch, switch="0")
    assert len(s.groups) == 1 and s.grouped_steps == 0 and s.plain_steps > 25
    assert s.mismatches == 0, s.first_mismatch
    assert s.kinds.get("prefill with context", 0) > 0 and s.kinds.get("decode", 0) > 0, s.kinds


def test_another_model_reads_as_the_tree_without_the_three_units(trees, beam_config, monkeypatch):
    """Another model with the switch on: the stock path, read for read what the port's tree without
    the three window-KV units gives (its sliding layers keep vllm-gaudi's own window: not this
    test's oracle, so the full layers' reads are the ones held exact)."""
    runs = [served_run(tree, beam_config, 0, 25, monkeypatch, model_type="llama") for tree in (trees(), trees(*UNITS))]
    for s in runs:
        assert len(s.groups) == 1 and s.grouped_steps == 0
    assert runs[0].rows_checked == runs[1].rows_checked > 0
    assert runs[0].mismatches == runs[1].mismatches and runs[0].first_mismatch == runs[1].first_mismatch
