"""Decode and verify steps over per-group block tables, on the vllm-gaudi tree named by
GAUDI_FIXES_ROOT (skipped without it), with the KV-cache groups and tables of vLLM's own
KVCacheManager for Beam's 52 layers under a window-sized cache.

For each group the tree's whole _create_decode_input_data builds the step from that group's table
(decode_step.py), the tree's VLLMKVCache.forward writes every layer's keys at the step's slot
mapping into the buffer the layer shares (window_kv.shared_buffer_layers), and the tree's
_set_block_mapping turns the block lists into the masks attention applies: the full group's
block list for full layers, the window block list for sliding layers. Every key each row attends
is read back and must be exactly the definition's (query i sees i - W < j <= i in sliding layers,
everything in full layers), written by that layer for that sequence: not the null block, not
another request's or another group's key. The run spans freed and reused blocks, finished and newly
admitted requests, and verify steps with uneven drafts (rejected drafts' keys left behind).
Prefix-cache hits and prefill chunks are covered at the rule level, against vLLM's manager, by
tests/runtime/window_kv/test_groups_vllm.py; the tree's prefill path per group is not run here.

This is what the runner wiring of issue 26 must do per group; it shows that with the port's
beam-exact-window the per-table code already serves a sliding group's null-prefixed table, and
that without the port it does not (vllm-gaudi's block-granular window reads too few keys).
"""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import torch
from decode_step import PaddedBatch, decode_step, write_kv
from gaudi_source import load
from test_fixes_gaudi import pytestmark  # noqa: F401  (skip without GAUDI_FIXES_ROOT)
from test_port_patches import PROCESSOR_CLS, tree  # noqa: F401  (the fixture: v0.30.0 only / port)

from beam_hpu.runtime.window_kv import groups as wkv
from tests.runtime.window_kv.test_groups_vllm import beam_kv_cache_config

BS, WINDOW, NUM_BLOCKS, K = 4, 8, 120, 3


class Cluster:
    """vLLM's manager, the buffers as the tree writes them, and a code book of key identities."""

    def __init__(self, tree, seed: int):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.kv_cache_manager import KVCacheManager

        self.tree, self.rng, self.SamplingParams = tree, random.Random(seed), SamplingParams
        _, kc = beam_kv_cache_config(BS, WINDOW, NUM_BLOCKS)
        self.groups = [g.layer_names for g in kc.kv_cache_groups]
        self.windows = [getattr(g.kv_cache_spec, "sliding_window", None) for g in kc.kv_cache_groups]
        self.manager = KVCacheManager(kc, max_model_len=512, scheduler_block_size=BS, hash_block_size=BS,
                                      enable_caching=False)
        self.buffer_of = {n: j for j, names in enumerate(wkv.shared_buffer_layers(self.groups)) for n in names}
        # One cache per shared buffer: the pool's blocks and the runner's pad block (id NUM_BLOCKS).
        self.caches = [torch.zeros((NUM_BLOCKS + 1) * BS) for _ in wkv.shared_buffer_layers(self.groups)]
        self.codes: dict[tuple, int] = {}
        self.set_mapping = load(tree.runner, "_set_block_mapping", PROCESSOR_CLS, torch=torch, math=math,
                                is_fake_hpu=lambda: True,
                                custom_tuple_replace=lambda m, _n, **kw: SimpleNamespace(**{**vars(m), **kw}))
        self.utils = tree.root / "vllm_gaudi/extension/utils.py"
        self.mismatches = 0
        self.null_columns = self.reused = self.rows_checked = 0
        self.owner: dict[int, tuple] = {}
        self.first_mismatch = None  # (layer, sequence, query position, keys read, keys wanted)

    def code(self, layer: str, tokens: list[int], pos: int) -> float:
        key = (layer, pos, tuple(tokens[:pos + 1]))
        return float(self.codes.setdefault(key, len(self.codes) + 1))

    def admit(self, rid: str, prompt: list[int]):
        from vllm.v1.request import Request

        req = Request(rid, prompt, self.SamplingParams(max_tokens=64), None)
        done = 0
        while done < len(prompt):  # prefill in chunks; its keys go straight to the buffers
            n = min(len(prompt) - done, 6)
            assert self.manager.allocate_slots(req, n) is not None
            tables = self.manager.get_block_ids(rid)
            for gid, names in enumerate(self.groups):
                slots = wkv.group_slots(tables[gid], range(done, done + n), BS)
                for name in names:
                    for pos, slot in zip(range(done, done + n), slots):
                        self.caches[self.buffer_of[name]][slot] = self.code(name, prompt, pos)
            done += n
            req.num_computed_tokens = done
        return SimpleNamespace(req=req, tokens=list(prompt))

    def step(self, seqs, num_tokens: list[int]) -> list[list[int]]:
        """One decode/verify step: sequence s computes num_tokens[s] rows (its last token and
        num_tokens[s] - 1 drafts), every group through the tree's own code."""
        drafts = [[self.rng.randrange(1000) for _ in range(n - 1)] for n in num_tokens]
        for seq, n in zip(seqs, num_tokens):
            assert self.manager.allocate_slots(seq.req, n) is not None
        context_lens = [len(s.tokens) - 1 for s in seqs]
        step_tokens = [s.tokens + d for s, d in zip(seqs, drafts)]
        padded = len(seqs) + 1
        for gid, names in enumerate(self.groups):
            rows = [self.manager.get_block_ids(s.req.request_id)[gid] for s in seqs]
            for seq, r in zip(seqs, rows):  # freed columns, and block ids that changed owner
                self.null_columns += wkv.NULL_BLOCK_ID in r
                for b in r:
                    if b != wkv.NULL_BLOCK_ID and self.owner.setdefault(b, (gid, seq.req.request_id)) != (
                            gid, seq.req.request_id):
                        self.owner[b] = (gid, seq.req.request_id)
                        self.reused += 1
            width = max(map(len, rows))
            table = torch.zeros((padded, width), dtype=torch.int32)
            for b, r in enumerate(rows):
                table[b, :len(r)] = torch.tensor(r, dtype=torch.int32)
            out = decode_step(self.tree.runner, block_table=table, context_lens=context_lens,
                              num_tokens=num_tokens, token_ids=[t[c:c + n] for t, c, n in
                                                                zip(step_tokens, context_lens, num_tokens)],
                              block_size=BS, window=WINDOW, num_kv_blocks=NUM_BLOCKS,
                              bucketing=PaddedBatch(padded))
            meta = out.attn_metadata
            slots = meta.slot_mapping.flatten()
            per_seq = slots.numel() // padded
            for name in names:  # the tree's cache write, every layer of the group
                values = torch.zeros(slots.numel())
                for s, (c, n) in enumerate(zip(context_lens, num_tokens)):
                    for j in range(n):
                        values[s * per_seq + j] = self.code(name, step_tokens[s], c + j)
                buf = self.buffer_of[name]
                self.caches[buf] = write_kv(self.utils, self.caches[buf], slots, values)
            self.check_reads(names, self.windows[gid], meta, context_lens, num_tokens, step_tokens, per_seq)
        return drafts

    def check_reads(self, names, window, meta, context_lens, num_tokens, step_tokens, per_seq) -> None:
        rows = meta.slot_mapping.numel()
        md = SimpleNamespace(block_size=BS, block_usage=meta.block_usage, block_groups=meta.block_groups,
                             window_block_usage=getattr(meta, "window_block_usage", None),
                             window_block_groups=getattr(meta, "window_block_groups", None))
        sliding = window is not None
        mapped = self.set_mapping(SimpleNamespace(block_size=BS), md, rows, "cpu", torch.float32,
                                  is_window_block=sliding)
        blocks = meta.window_block_list if sliding else meta.block_list
        groups = mapped.window_block_groups if sliding else mapped.block_groups
        bias = mapped.window_attn_bias if sliding else mapped.attn_bias
        for name in names:
            cache = self.caches[self.buffer_of[name]]
            got = [[] for _ in range(rows)]
            for i, (bid, row) in enumerate(zip(blocks.tolist(), groups.tolist())):
                if 0 <= row < rows:
                    for o in range(BS):
                        if bias[i, o] == 0:
                            got[row].append(int(cache[bid * BS + o]))
            for s, (c, n) in enumerate(zip(context_lens, num_tokens)):
                for j in range(n):
                    q = c + j
                    lo = 0 if window is None else max(0, q - window + 1)
                    want = sorted(int(self.code(name, step_tokens[s], p)) for p in range(lo, q + 1))
                    self.rows_checked += 1
                    if sorted(got[s * per_seq + j]) != want:
                        self.mismatches += 1
                        if self.first_mismatch is None:
                            inv = {v: k[:2] for k, v in self.codes.items()}
                            self.first_mismatch = (name, s, q, [inv.get(x) for x in sorted(got[s * per_seq + j])],
                                                   [inv.get(x) for x in want])
        if sliding:  # the window lists never name the null block for a real row
            real = {s * per_seq + j for s, n in enumerate(num_tokens) for j in range(n)}
            assert all(b != wkv.NULL_BLOCK_ID for b, r in zip(blocks.tolist(), groups.tolist()) if r in real)

    def commit(self, seqs, drafts) -> None:
        """Each sequence accepts some of its drafts and gains a bonus token; rejected drafts' keys
        stay written past the sequence until a later step writes those positions again."""
        for seq, d in zip(seqs, drafts):
            accepted = self.rng.randint(0, len(d))
            new = d[:accepted] + [self.rng.randrange(1000)]
            seq.req.num_computed_tokens += 1 + accepted
            seq.tokens += new
            seq.req.append_output_token_ids(new)


def run(tree, seed: int, steps: int) -> Cluster:
    cluster = Cluster(tree, seed)
    rng = cluster.rng
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(2, 20))] for _ in range(3)]
    seqs = [cluster.admit(f"r{i}", p) for i, p in enumerate(prompts)]
    for seq in seqs:  # the prompt's last token is sampled: one committed token to compute
        seq.tokens.append(rng.randrange(1000))
        seq.req.append_output_token_ids(seq.tokens[-1])
    admitted = len(seqs)
    for t in range(steps):
        verify = t % 2 == 1
        num_tokens = [rng.randint(1, K + 1) if verify else 1 for _ in seqs]
        cluster.commit(seqs, cluster.step(seqs, num_tokens))
        if t % 7 == 6:  # a request finishes (its blocks go back) and another is admitted
            done = seqs.pop(0)
            cluster.manager.free(done.req)
            new = cluster.admit(f"r{admitted}", [rng.randrange(1000) for _ in range(rng.randrange(2, 24))])
            admitted += 1
            new.tokens.append(rng.randrange(1000))
            new.req.append_output_token_ids(new.tokens[-1])
            seqs.append(new)
    return cluster


def test_per_group_decode_and_verify_steps_read_exact_windows(tree):
    cluster = run(tree, seed=0, steps=16)
    assert len(cluster.groups) == 6 and len(cluster.caches) == 9
    # The run met freed columns and blocks that changed owner (group or request).
    assert cluster.null_columns > 0 and cluster.reused > 0 and cluster.rows_checked > 1500
    if tree.port:
        assert cluster.mismatches == 0, cluster.first_mismatch
    else:  # vllm-gaudi's block-granular window (and verify rows' shared table) read the wrong keys
        assert cluster.mismatches > 0
