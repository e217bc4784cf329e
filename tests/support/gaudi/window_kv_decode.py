"""Decode and verify steps of a vllm-gaudi tree over the per-group block tables of vLLM's own
KVCacheManager for Beam's 52 layers under a window-sized cache (a KVPool).

For each group the tree's whole _create_decode_input_data builds the step from that group's table
(decode_step.py), the tree's VLLMKVCache.forward writes every layer's keys at the step's slot
mapping into the buffer the layer shares, and the tree's _set_block_mapping turns the block lists
into the masks attention applies: the full group's block list for full layers, the window block
list for sliding layers. Every key each row attends is read back (oracles.keys_read) and compared
with the definition's (KVPool.miss)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from beam_hpu.runtime.window_kv import groups as wkv
from tests.support.gaudi.decode_step import PaddedBatch, decode_step, write_kv
from tests.support.gaudi.source import block_mapping
from tests.support.window_kv.configs import beam_kv_cache_config
from tests.support.window_kv.oracles import group_slots, keys_read, window_positions
from tests.support.window_kv.pool import KVPool

BS, WINDOW, NUM_BLOCKS = 4, 8, 120


class Cluster(KVPool):
    """vLLM's manager, the buffers as the tree writes them, and a code book of key identities."""

    def __init__(self, tree, seed: int):
        from vllm.sampling_params import SamplingParams

        # One cache per shared buffer: the pool's blocks and the runner's pad block (id NUM_BLOCKS).
        super().__init__(beam_kv_cache_config(BS, WINDOW, NUM_BLOCKS)[1], BS, NUM_BLOCKS, max_model_len=512,
                         caching=False)
        self.tree, self.rng, self.SamplingParams = tree, random.Random(seed), SamplingParams
        self.set_mapping = block_mapping(tree.runner)
        self.utils = tree.root / "vllm_gaudi/extension/utils.py"

    def admit(self, rid: str, prompt: list[int]):
        from vllm.v1.request import Request

        req = Request(rid, prompt, self.SamplingParams(max_tokens=64), None)
        done = 0
        while done < len(prompt):  # prefill in chunks; its keys go straight to the buffers
            n = min(len(prompt) - done, 6)
            assert self.manager.allocate_slots(req, n) is not None
            tables = self.manager.get_block_ids(rid)
            for gid, names in enumerate(self.groups):
                slots = group_slots(tables[gid], range(done, done + n), BS)
                for name in names:
                    self.write_slots(name, slots, prompt, range(done, done + n))
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
        rids = [s.req.request_id for s in seqs]
        tables = [[self.manager.get_block_ids(rid)[gid] for rid in rids] for gid in range(len(self.groups))]
        self.track(rids, tables)  # freed columns, and block ids that changed owner
        for gid, names in enumerate(self.groups):
            rows = tables[gid]
            table = torch.zeros((padded, max(map(len, rows))), dtype=torch.int32)
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
        blocks = (meta.window_block_list if sliding else meta.block_list).tolist()
        groups = (mapped.window_block_groups if sliding else mapped.block_groups).tolist()
        bias = mapped.window_attn_bias if sliding else mapped.attn_bias
        for name in names:
            got = keys_read(self.cache(name), blocks, groups, bias, rows, BS)
            for s, (c, n) in enumerate(zip(context_lens, num_tokens)):
                for j in range(n):
                    want = [int(self.code(name, step_tokens[s], p)) for p in window_positions(c + j, window)]
                    self.miss(got[s * per_seq + j], want, (name, s, c + j))
        if sliding:  # the window lists never name the null block for a real row
            real = {s * per_seq + j for s, n in enumerate(num_tokens) for j in range(n)}
            assert all(b != wkv.NULL_BLOCK_ID for b, r in zip(blocks, groups) if r in real)

    def commit(self, seqs, drafts) -> None:
        """Each sequence accepts some of its drafts and gains a bonus token; rejected drafts' keys
        stay written past the sequence until a later step writes those positions again."""
        for seq, d in zip(seqs, drafts):
            accepted = self.rng.randint(0, len(d))
            new = d[:accepted] + [self.rng.randrange(1000)]
            seq.req.num_computed_tokens += 1 + accepted
            seq.tokens += new
            seq.req.append_output_token_ids(new)
