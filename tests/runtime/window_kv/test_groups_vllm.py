"""The window-sized KV rules against vLLM's own KV-cache grouping and KV-cache manager.

Beam's 52 layers (9 full, 43 sliding by `config.layer_types`' rule) get specs from
`window_kv.window_kv_spec`; vLLM's `get_kv_cache_groups` / `get_kv_cache_config_from_groups`
form the hybrid groups and their buffer layout, and vLLM's `KVCacheManager` allocates, frees,
caches and reuses blocks while a scripted scheduler runs requests through every step kind. A
simulated device store (tests/support/window_kv/pool.py) holds, per (buffer, slot), the identity of
the key written there (layer, position, the tokens through it: what the K/V depends on). Every
read the rules produce must return the exact-window definition's keys with those identities.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

import pytest
import torch

from beam_hpu.runtime.sliding_window import hpu_window as win
from beam_hpu.runtime.window_kv import groups as wkv
from tests.support.window_kv.configs import NUM_LAYERS, beam_kv_cache_config, beam_layer_windows, vllm_config
from tests.support.window_kv.oracles import (
    GroupGeometry,
    group_decode_tables,
    group_prefill_context,
    group_slots,
    window_positions,
)
from tests.support.window_kv.pool import KVPool

pytest.importorskip("vllm")
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_groups  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

# The simulated pool: small enough that freed blocks come back within a run.
NUM_BLOCKS = 120


def test_beam_specs_form_one_full_and_five_sliding_groups():
    specs, kc = beam_kv_cache_config(128, 512, num_blocks=1000)
    assert sum(isinstance(s, SlidingWindowSpec) for s in specs.values()) == 43
    assert all(s.sliding_window == 512 for s in specs.values() if isinstance(s, SlidingWindowSpec))
    kinds = [type(g.kv_cache_spec).__name__ for g in kc.kv_cache_groups]
    assert sorted(kinds) == ["FullAttentionSpec"] + ["SlidingWindowSpec"] * 5
    assert sorted(len(g.layer_names) for g in kc.kv_cache_groups) == [8, 8, 9, 9, 9, 9]
    # A block costs 9 layers' pages, not 52: the pool holds 52/9 as many blocks in the same bytes.
    assert kc.num_blocks == 1000
    assert len(wkv.shared_buffer_layers([g.layer_names for g in kc.kv_cache_groups])) == 9


def test_shared_buffers_are_vllms_aliased_byte_ranges():
    """vLLM lays each group's layers out from byte 0 of one allocation; layers at the same byte
    offset alias. shared_buffer_layers must put exactly those layers in one buffer."""
    _, kc = beam_kv_cache_config(128, 512, num_blocks=64)
    offset_of = {}
    for t in kc.kv_cache_tensors:
        for li, name in enumerate(t.layers):
            offset_of[name] = t.offset + li * t.layer_stride
    buffers = wkv.shared_buffer_layers([g.layer_names for g in kc.kv_cache_groups])
    by_offset = defaultdict(set)
    for name, off in offset_of.items():
        by_offset[off].add(name)
    assert sorted(map(sorted, by_offset.values())) == sorted(map(sorted, buffers))
    assert sum(map(len, buffers)) == NUM_LAYERS


# ------------------------------------------------------------------ the simulated run


@dataclass
class Seq:
    req: Request
    tokens: list[int]  # prompt, then every committed output token
    max_new: int
    furthest: int = -1  # the furthest position any step has scheduled


def ident(pool: KVPool, layer: str, tokens: list[int], pos: int) -> int:
    return int(pool.code(layer, tokens, pos))


class Run(KVPool):
    def __init__(self, bs: int, window: int, num_blocks: int, seed: int, *, table_of_group=None):
        super().__init__(beam_kv_cache_config(bs, window, num_blocks)[1], bs, num_blocks, max_model_len=4096,
                         caching=True)
        self.window = window
        self.geometry = [GroupGeometry(w) for w in self.windows]
        # Which group's table a group's layers read; the identity unless a test breaks it.
        self.table_of_group = table_of_group or list(range(len(self.groups)))
        self.rng = random.Random(seed)
        self.kinds = defaultdict(int)
        self.reads = 0
        self.allocations = 0  # block ids handed out by vLLM's pool, over all groups

    def allocate(self, req: Request, *args):
        new = self.manager.allocate_slots(req, *args)
        if new is not None:
            self.allocations += sum(len(ids) for ids in new.get_block_ids())
        return new

    def tables(self, seq: Seq) -> tuple[list[int], ...]:
        return self.manager.get_block_ids(seq.req.request_id)

    def write_and_check(self, seq: Seq, tokens: list[int], start: int, n: int, kind: str) -> None:
        """Rows at positions start..start+n-1 write their keys, then read (decode-style rows for
        decode and verify steps, a chunk over cached context for prefill)."""
        tables = self.tables(seq)
        positions = list(range(start, start + n))
        for gid, names in enumerate(self.groups):
            slots = group_slots(tables[gid], positions, self.bs)
            for name in names:
                self.write_slots(name, slots, tokens, positions)
        for gid, names in enumerate(self.groups):
            geom, table = self.geometry[gid], tables[self.table_of_group[gid]]
            if kind == "prefill":
                self.check_prefill(names, geom, table, tokens, start, n)
            else:
                for pos in positions:  # decode, and verify rows each with the table through its own block
                    self.check_decode_row(names, geom, table, tokens, pos)
        # Tokens in flight: this step's, or further if an earlier verify step allocated blocks
        # for drafts past them (rejected drafts keep their blocks).
        seq.furthest = max(seq.furthest, start + n - 1)
        in_flight = seq.furthest - start + 1
        for gid, geom in enumerate(self.geometry):
            if geom.sliding_window is not None:
                held = sum(b != wkv.NULL_BLOCK_ID for b in tables[gid])
                assert held <= wkv.sliding_blocks_bound(geom.sliding_window, self.bs, in_flight), (kind, held)
        self.kinds[kind] += 1

    def check_decode_row(self, names, geom, table, tokens, pos) -> None:
        (t,), (s,) = group_decode_tables([table], [pos], geom, self.bs)
        first_col = 0 if geom.sliding_window is None else win.decode_window_blocks(pos, geom.sliding_window,
                                                                                    self.bs).start
        expect_positions = sorted(window_positions(pos, geom.sliding_window))
        for name in names:
            got = []
            for k, block in enumerate(t):
                for o in range(self.bs):
                    p = (first_col + k) * self.bs + o
                    if (k == 0 and o < s) or p > pos:
                        continue
                    got.append(int(self.cache(name)[block * self.bs + o]))
            assert got == [ident(self, name, tokens, p) for p in expect_positions], (name, pos)
            self.reads += 1

    def check_prefill(self, names, geom, table, tokens, ctx, n) -> None:
        (blocks,) = group_prefill_context([table], [ctx], geom, self.bs)
        window = geom.sliding_window or (ctx + n)  # full attention: a window covering everything
        starts = win.prefill_window_block_starts([ctx], window, self.bs) if geom.sliding_window else [0]
        mask = win.prefill_window_mask([ctx], [n], window, self.bs, ctx_block_starts=starts,
                                       num_ctx_blocks=len(blocks))[0]  # [n, C*bs + n]
        ctx_slots = len(blocks) * self.bs
        for name in names:
            for i in range(n):
                row = mask[i]
                got = []
                for key in torch.nonzero(row[:ctx_slots]).flatten().tolist():
                    got.append(int(self.cache(name)[blocks[key // self.bs] * self.bs + key % self.bs]))
                chunk_keys = [ctx + j for j in torch.nonzero(row[ctx_slots:]).flatten().tolist()]
                got += [ident(self, name, tokens, p) for p in chunk_keys]  # the chunk's own keys, not from the cache
                expect = sorted(window_positions(ctx + i, geom.sliding_window))
                assert got == [ident(self, name, tokens, p) for p in expect], (name, ctx, i)
            self.reads += 1

    # ---- a scripted scheduler over vLLM's manager

    def admit(self, rid: str, prompt: list[int], max_new: int) -> Seq | None:
        req = Request(rid, prompt, SamplingParams(max_tokens=max_new), None, block_hasher=self.hasher)
        seq = Seq(req, list(prompt), max_new)
        computed, n_hit, _ = self.manager.get_computed_blocks(req)  # never the last prompt token
        chunk = min(len(prompt) - n_hit, self.rng.choice([self.bs, 2 * self.bs + 1, 5 * self.bs]))
        if self.allocate(req, chunk, n_hit, computed) is None:
            return None
        if n_hit:
            self.kinds["prefix hit"] += 1
        req.num_computed_tokens = n_hit
        self.write_and_check(seq, seq.tokens, n_hit, chunk, "prefill")
        req.num_computed_tokens += chunk
        if req.num_computed_tokens == req.num_prompt_tokens:
            self.emit(seq, [self.rng.randrange(1000)])
        return seq

    def step(self, seq: Seq) -> bool:
        """One scheduled step for `seq`; False once it is finished (and freed)."""
        req = seq.req
        done = req.num_computed_tokens
        if done < req.num_prompt_tokens:
            chunk = min(req.num_prompt_tokens - done, self.rng.choice([1, self.bs - 1, 3 * self.bs + 2]))
            if self.allocate(req, chunk) is None:
                return self.preempt(seq)
            self.write_and_check(seq, seq.tokens, done, chunk, "prefill")
            req.num_computed_tokens += chunk
            if req.num_computed_tokens == req.num_prompt_tokens:
                self.emit(seq, [self.rng.randrange(1000)])
            return True
        assert done == len(seq.tokens) - 1
        if len(seq.tokens) - req.num_prompt_tokens >= seq.max_new:
            self.manager.free(req)
            return False
        # The last committed token is not yet computed: a decode or a verify step computes it.
        k = self.rng.choice([0, 0, 1, 3])
        drafts = [self.rng.randrange(1000) for _ in range(k)]
        step_tokens = seq.tokens + drafts
        if self.allocate(req, 1 + k) is None:
            return self.preempt(seq)
        self.write_and_check(seq, step_tokens, done, 1 + k, "verify" if k else "decode")
        accepted = self.rng.randint(0, k)
        # Accepted drafts are committed with the bonus token; rejected rows' keys stay written
        # but are past the sequence and rewritten before any query reads them.
        req.num_computed_tokens += 1 + accepted
        self.emit(seq, drafts[:accepted] + [self.rng.randrange(1000)])
        return True

    def preempt(self, seq: Seq) -> bool:
        """The pool is full: drop the request and free its blocks (a scheduler would requeue it)."""
        self.manager.free(seq.req)
        self.kinds["preempted"] += 1
        return False

    def emit(self, seq: Seq, new: list[int]) -> None:
        seq.tokens += new
        seq.req.append_output_token_ids(new)


def drive(run: Run, steps: int) -> None:
    rng = run.rng
    shared = [rng.randrange(1000) for _ in range(6 * run.bs + 3)]
    running: list[Seq] = []
    next_id = 0
    for _ in range(steps):
        if len(running) < 4 and rng.random() < 0.3:
            prefix = shared[: rng.randrange(len(shared))] if rng.random() < 0.6 else []
            prompt = prefix + [rng.randrange(1000) for _ in range(rng.randrange(1, 4 * run.bs))]
            seq = run.admit(f"r{next_id}", prompt, max_new=rng.randrange(1, 5 * run.bs))
            next_id += 1
            if seq is not None:
                running.append(seq)
            continue
        if running:
            seq = rng.choice(running)
            if not run.step(seq):
                running.remove(seq)


@pytest.mark.parametrize("bs,window,seed", [(4, 8, 0), (4, 7, 1), (4, 5, 2), (8, 8, 3)])
def test_rules_read_exact_windows_through_vllms_manager(bs, window, seed):
    run = Run(bs, window, num_blocks=NUM_BLOCKS, seed=seed)
    drive(run, 400)
    # Every step kind was exercised, and every block id was handed out more than once.
    for kind in ("prefill", "prefix hit", "decode", "verify"):
        assert run.kinds[kind] > 0, dict(run.kinds)
    assert run.reads > 1000
    assert run.allocations > 2 * NUM_BLOCKS


def test_reading_another_groups_table_is_caught():
    """The check bites: sliding layers reading the first sliding group's table (one table for
    every sliding layer, as a single-group runner would) read keys another group wrote."""
    _, kc = beam_kv_cache_config(4, 8, NUM_BLOCKS)
    sliding = [gid for gid, g in enumerate(kc.kv_cache_groups) if isinstance(g.kv_cache_spec, SlidingWindowSpec)]
    table_of_group = list(range(len(kc.kv_cache_groups)))
    for gid in sliding:
        table_of_group[gid] = sliding[0]
    run = Run(4, 8, num_blocks=NUM_BLOCKS, seed=0, table_of_group=table_of_group)
    with pytest.raises(AssertionError):
        drive(run, 400)


def test_a_drafter_window_is_allocated_full_so_groups_stay_six():
    """An EAGLE3 drafter layer with its own 4,096-token window: as a sliding spec it makes vLLM
    cut every layer into its own group; allocation_windows keeps Beam's 1 full + 5 sliding."""
    full = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=128, dtype=torch.bfloat16)
    windows = {**beam_layer_windows(512), "drafter.layers.0.self_attn.attn": 4096}
    naive = get_kv_cache_groups(vllm_config(), {n: wkv.window_kv_spec(full, w) for n, w in windows.items()})
    assert len(naive) == NUM_LAYERS + 1 and {len(g.layer_names) for g in naive} == {1}
    kept = wkv.allocation_windows(windows)
    assert kept["drafter.layers.0.self_attn.attn"] is None
    assert {w for n, w in kept.items() if n.startswith("model.")} == {None, 512}
    groups = get_kv_cache_groups(vllm_config(), {n: wkv.window_kv_spec(full, w) for n, w in kept.items()})
    kinds = sorted((type(g.kv_cache_spec).__name__, len(g.layer_names)) for g in groups)
    assert [k for k, _ in kinds].count("SlidingWindowSpec") == 5 and len(groups) == 6
    assert ("FullAttentionSpec", 10) in kinds  # 9 full layers and the drafter's
