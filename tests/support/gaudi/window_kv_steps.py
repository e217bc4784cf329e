"""Whole steps of a (patched) vllm-gaudi tree's own HPUModelRunner._prepare_inputs
(window_kv_runner.py) over the per-group block tables of vLLM's own KVCacheManager (prefix caching
on) for Beam's 52 layers: a scripted scheduler (prompts with prefix-cache hits, chunked prefill,
merged prefill, decodes and verify rows with uneven drafts, requests finishing and admitted).

Each layer writes its keys with the tree's VLLMKVCache.forward at the slot mapping of its group's
metadata into the buffer it shares (a KVPool); every key each query then attends (decode: the
tree's _set_block_mapping over the group's block lists; prefill: the context blocks with the
tree's _set_attn_bias_for_sliding_window in sliding layers, the whole context in full layers) is
read back and compared with the definition's. Each group's metadata is compared with what the
tree without beam-window-kv-steps builds from that group's table alone (`compare_with_reference`).
"""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from beam_hpu.runtime.window_kv import groups as wkv
from beam_hpu.runtime.window_kv import hpu_steps as steps
from tests.support.gaudi.decode_step import write_kv
from tests.support.gaudi.source import PROCESSOR_CLS, block_mapping, load, namespace_replace
from tests.support.gaudi.window_kv_runner import make_runner, set_batch
from tests.support.window_kv.configs import beam_kv_cache_config, full_only_config
from tests.support.window_kv.oracles import keys_read, window_positions
from tests.support.window_kv.pool import KVPool

BS, WINDOW, NUM_BLOCKS, WIDTH = 4, 8, 240, 64


@dataclass
class Seq:
    rid: str
    req: object
    tokens: list[int]
    prompt_len: int
    max_new: int
    furthest: int = -1
    drafts: list[int] = field(default_factory=list)

    @property
    def computed(self) -> int:
        return self.req.num_computed_tokens


class Steps(KVPool):
    """vLLM's manager and a scripted scheduler; each step built by the patched tree's runner."""

    def __init__(self, trees, seed: int, window_kv: bool = True, merged: bool = False, dp_padding: int = 0,
                 with_unit: bool = True, async_scheduling: bool = False, kc=None, runner=None):
        self.rng = random.Random(seed)
        if kc is None:  # `kc` and `runner` given: a runner built elsewhere (the end-to-end test's)
            kc = beam_kv_cache_config(BS, WINDOW, NUM_BLOCKS)[1] if window_kv else full_only_config(BS, NUM_BLOCKS)
        super().__init__(kc, BS, NUM_BLOCKS, max_model_len=1024, caching=True)
        self.window_kv = window_kv
        args = dict(block_size=BS, window=WINDOW, num_kv_blocks=NUM_BLOCKS, merged_prefill=merged,
                    dp_padding=dp_padding, async_scheduling=async_scheduling)
        self.with_unit = with_unit  # without it: the tree builds every layer's metadata from group 0's table
        self.runner = runner or make_runner(trees[0 if with_unit else 1].runner, kc, **args)
        self.reference = make_runner(trees[1].runner, kc, **args)  # the tree without this unit
        self.set_mapping = block_mapping(trees[0].runner)
        self.set_window_bias = load(trees[0].runner, "_set_attn_bias_for_sliding_window", PROCESSOR_CLS, torch=torch,
                                    custom_tuple_replace=namespace_replace)
        self.utils = trees[0].root / "vllm_gaudi/extension/utils.py"
        self.kinds: dict[str, int] = {}
        self.invalid_listed = 0
        self.seqs: list[Seq] = []
        self.admitted = 0
        self.shared = [self.rng.randrange(1000) for _ in range(6 * BS + 3)]  # prompts' common prefix

    # ---- the scheduler

    def admit(self, fresh: bool = False) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        prefix = self.shared[:self.rng.randrange(2 * BS, len(self.shared))] if self.rng.random() < 0.7 else []
        if fresh:  # no prefix: a first chunk without context, which prefill batches may merge
            prefix = [self.rng.randrange(1000, 2000)]
        prompt = prefix + [
            self.rng.randrange(1000) for _ in range(self.rng.randrange(1, 3 * WINDOW))]
        rid = f"r{self.admitted}"
        self.admitted += 1
        req = Request(rid, prompt, SamplingParams(max_tokens=64), None, block_hasher=self.hasher)
        computed, n_hit, _ = self.manager.get_computed_blocks(req)
        self.kinds["prefix hit"] = self.kinds.get("prefix hit", 0) + (n_hit > 0)
        seq = Seq(rid, req, list(prompt), len(prompt), self.rng.randrange(2, 3 * WINDOW))
        seq.pending = (n_hit, computed)
        self.seqs.append(seq)

    def schedule(self) -> list[tuple[Seq, int]]:
        """(seq, tokens scheduled) in batch order: decodes (one token, then verify rows), prefills."""
        decodes, prefills = [], []
        for seq in self.seqs:
            pending = getattr(seq, "pending", None)
            if pending is not None:  # a new request: its prefix hit counts as computed
                n_hit, computed = pending
                chunk = min(seq.prompt_len - n_hit, self.rng.choice([BS, 2 * BS + 1, 5 * BS, 64]))
                assert self.manager.allocate_slots(seq.req, chunk, n_hit, computed) is not None
                seq.req.num_computed_tokens = n_hit
                del seq.pending
                prefills.append((seq, chunk))
            elif seq.computed < seq.prompt_len:
                chunk = min(seq.prompt_len - seq.computed, self.rng.choice([1, BS - 1, 3 * BS + 2]))
                assert self.manager.allocate_slots(seq.req, chunk) is not None
                prefills.append((seq, chunk))
            else:
                k = self.rng.choice([0, 0, 1, 3])
                seq.drafts = [self.rng.randrange(1000) for _ in range(k)]
                assert self.manager.allocate_slots(seq.req, 1 + k) is not None
                decodes.append((seq, 1 + k))
        decodes.sort(key=lambda d: d[1] > 1)  # ensure_multi_token_decodes_last
        return decodes + prefills

    def commit(self, batch) -> None:
        for seq, n in batch:
            if seq.computed < seq.prompt_len:
                seq.req.num_computed_tokens += n
                if seq.computed == seq.prompt_len:
                    self.emit(seq, [self.rng.randrange(1000)])
            else:
                accepted = self.rng.randint(0, len(seq.drafts))
                seq.req.num_computed_tokens += 1 + accepted
                self.emit(seq, seq.drafts[:accepted] + [self.rng.randrange(1000)])
                seq.drafts = []
        for seq in list(self.seqs):
            if len(seq.tokens) - seq.prompt_len >= seq.max_new:
                self.manager.free(seq.req)
                self.seqs.remove(seq)

    def emit(self, seq: Seq, new: list[int]) -> None:
        seq.tokens += new
        seq.req.append_output_token_ids(new)

    # ---- one step through the runner

    def plan_step(self):
        """Admit, schedule and lay out one step: (batch, number of decodes, views of the batch's
        requests, every group's table rows, the scheduler output)."""
        if len(self.seqs) < 4 and self.rng.random() < 0.7 or not self.seqs:
            self.admit()
        if len(self.seqs) < 4 and self.rng.random() < 0.3:  # two fresh prompts in one step
            self.admit(fresh=True)
            self.admit(fresh=True)
        batch = self.schedule()
        num_decodes = sum(seq.computed >= seq.prompt_len for seq, _ in batch)
        order = [seq for seq, _ in batch]
        views = [SimpleNamespace(rid=s.rid, tokens=s.tokens + s.drafts, computed=s.computed,
                                 prompt_len=s.prompt_len) for s in order]
        tables = [[list(self.manager.get_block_ids(s.rid)[g]) for s in order] for g in range(len(self.groups))]
        self.track([s.rid for s in order], tables)
        sched = SimpleNamespace(total_num_scheduled_tokens=sum(n for _, n in batch),
                                num_scheduled_tokens={s.rid: n for s, n in batch},
                                scheduled_spec_decode_tokens={s.rid: s.drafts for s in order if s.drafts})
        return batch, num_decodes, views, tables, sched

    def step(self) -> None:
        batch, num_decodes, views, tables, sched = self.plan_step()
        order = [seq for seq, _ in batch]
        set_batch(self.runner, views, tables, WIDTH)
        self.runner.invalid_req_indices = []
        out = self.runner._prepare_inputs(sched, len(batch) - num_decodes, num_decodes)
        if self.with_unit:
            self.compare_with_reference(out, views, tables, sched, len(batch) - num_decodes, num_decodes)
        (prefill, dummy_prefill), (decode, dummy_decode) = out
        self.check_dummies(dummy_prefill, dummy_decode)
        if num_decodes:
            self.decode_writes_and_reads(decode, order[:num_decodes], [n for _, n in batch[:num_decodes]])
        for i, rids in enumerate(prefill.request_ids):
            self.prefill_writes_and_reads(prefill.attn_metadata[i], [self.find(r) for r in rids])
        self.check_held(batch)
        self.commit(batch)

    def find(self, rid: str) -> Seq:
        return next(s for s in self.seqs if s.rid == rid)

    def check_held(self, batch) -> None:
        """A sliding group holds at most the window's blocks for what is in flight."""
        for seq, n in batch:
            seq.furthest = max(seq.furthest, seq.computed + n - 1)
            in_flight = seq.furthest - seq.computed + 1
            for g, w in enumerate(self.windows):
                if w is not None:
                    held = sum(b != wkv.NULL_BLOCK_ID for b in self.manager.get_block_ids(seq.rid)[g])
                    assert held <= wkv.sliding_blocks_bound(w, BS, in_flight), (seq.rid, g, held)

    def check_dummies(self, dummy_prefill, dummy_decode) -> None:
        """DP padding's dummy batches: none without padding; with it, one metadata per group too."""
        if not self.runner.get_dp_padding(1):
            assert dummy_prefill is None and dummy_decode is None
            return
        for dummy, kind in ((dummy_prefill, "dummy prefill"), (dummy_decode, "dummy decode")):
            if dummy is None:
                continue
            mds = dummy.attn_metadata if isinstance(dummy.attn_metadata, list) else [dummy.attn_metadata]
            for md in mds:
                assert len(self.group_metadata(md)) == len(self.groups)
            self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def group_metadata(self, md) -> list:
        if not self.with_unit:
            return [md] * len(self.groups)
        if self.window_kv:
            assert isinstance(md, wkv.GroupedMetadata)
            return md.groups
        assert not isinstance(md, wkv.GroupedMetadata)
        return [md]

    def compare_with_reference(self, out, views, tables, sched, num_prefills, num_decodes) -> None:
        """Group g's metadata is what the tree without the unit builds from group g's table; with
        one full group (the switch off) the whole step equals the unit-less tree's."""
        for g in range(len(self.groups)):
            set_batch(self.reference, views, [tables[g]], WIDTH)
            self.reference.invalid_req_indices = []
            ref = self.reference._prepare_inputs(sched, num_prefills, num_decodes)
            # async scheduling's discarded partial-prefill logits: listed once, as one build lists them
            assert self.runner.invalid_req_indices == self.reference.invalid_req_indices
            self.invalid_listed += len(self.reference.invalid_req_indices)
            if not self.window_kv:  # the two trees' records are distinct classes: compare their contents
                steps.same_value([plain(ref), plain(out)], "step")
                return
            (ref_p, _), (ref_d, _) = ref
            (got_p, _), (got_d, _) = out
            if num_decodes:
                steps.same_value([ref_d.attn_metadata, got_d.attn_metadata.groups[g]], f"decode group {g}")
            for i, md in enumerate(got_p.attn_metadata):
                steps.same_value([ref_p.attn_metadata[i], md.groups[g]], f"prefill {i} group {g}")
            same = [(ref_d, got_d), (ref_p, got_p)]
            for r, o in same:
                steps.same_value([{k: v for k, v in vars(r).items() if k != "attn_metadata"},
                                  {k: v for k, v in vars(o).items() if k != "attn_metadata"}], "inputs")

    # ---- writes and reads

    def write(self, names, slots: torch.Tensor, values: torch.Tensor) -> None:
        real = slots >= 0
        for name in names:
            buf = self.buffer_of[name]
            self.caches[buf] = write_kv(self.utils, self.caches[buf], slots[real], values[name][real])

    def decode_writes_and_reads(self, decode, seqs, num_tokens) -> None:
        self.kinds["verify" if max(num_tokens) > 1 else "decode"] = self.kinds.get(
            "verify" if max(num_tokens) > 1 else "decode", 0) + 1
        for g, md in enumerate(self.group_metadata(decode.attn_metadata)):
            names, window = self.groups[g], self.windows[g]
            slots = md.slot_mapping.flatten()
            per_seq = max(num_tokens)  # rows are [padded batch, the step's most tokens], flattened
            values = {n: torch.zeros(slots.numel()) for n in names}
            for s, (seq, n) in enumerate(zip(seqs, num_tokens)):
                for j in range(n):
                    for name in names:
                        values[name][s * per_seq + j] = self.code(name, seq.tokens + seq.drafts, seq.computed + j)
            real_rows = [s * per_seq + j for s, n in enumerate(num_tokens) for j in range(n)]
            assert all(int(slots[r]) // BS != wkv.NULL_BLOCK_ID for r in real_rows)  # never the null block
            self.write(names, slots, values)
            rows = slots.numel()
            sliding = window is not None
            mapped = self.set_mapping(SimpleNamespace(block_size=BS), SimpleNamespace(
                block_size=BS, block_usage=md.block_usage, block_groups=md.block_groups,
                window_block_usage=md.window_block_usage, window_block_groups=md.window_block_groups), rows, "cpu",
                torch.float32, is_window_block=sliding)
            blocks = (md.window_block_list if sliding else md.block_list).tolist()
            owners = (mapped.window_block_groups if sliding else mapped.block_groups).tolist()
            bias = mapped.window_attn_bias if sliding else mapped.attn_bias
            real = {s * per_seq + j for s, n in enumerate(num_tokens) for j in range(n)}
            assert not any(b == wkv.NULL_BLOCK_ID for b, r in zip(blocks, owners) if r in real and sliding)
            for name in names:
                got = keys_read(self.cache(name), blocks, owners, bias, rows, BS)
                for s, (seq, n) in enumerate(zip(seqs, num_tokens)):
                    for j in range(n):
                        q = seq.computed + j
                        want = [int(self.code(name, seq.tokens + seq.drafts, p)) for p in window_positions(q, window)]
                        self.miss(got[s * per_seq + j], want, (name, seq.rid, q))

    def prefill_writes_and_reads(self, grouped, seqs) -> None:
        processor = SimpleNamespace(
            prefill_use_fusedsdpa=True, use_window_sdpa=False, slice_thld=8192, slice_size=1024, block_size=BS,
            vllm_config=SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="beam"))))
        for g, md in enumerate(self.group_metadata(grouped)):
            names, window = self.groups[g], self.windows[g]
            slots = md.slot_mapping  # [batch, seq]; merged prefill: [1, the batch's tokens back to back]
            ctx_lens = md.context_lens_tensor.tolist()
            query_lens = md.seq_lens_tensor.tolist()
            merged = self.runner.use_merged_prefill
            flat = slots.flatten()
            values = {n: torch.zeros(flat.numel()) for n in names}
            real = torch.zeros(flat.numel(), dtype=torch.bool)
            for b, seq in enumerate(seqs):
                start = sum(query_lens[:b]) if merged else b * slots.shape[1]
                for j in range(query_lens[b]):
                    real[start + j] = True
                    for name in names:
                        values[name][start + j] = self.code(name, seq.tokens, ctx_lens[b] + j)
            assert (flat[~real] == -1).all()  # padding writes nowhere
            assert (flat[real] >= 0).all() and (flat[real] // BS != wkv.NULL_BLOCK_ID).all()
            self.write(names, flat, values)
            kind = "merged prefill" if len(seqs) > 1 else "prefill with context" if ctx_lens[0] else "prefill"
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            if not any(ctx_lens[:len(seqs)]):
                continue  # no context: the chunk attends only itself (stock causal window mask)
            assert len(seqs) == 1  # a request with context is its own batch (_can_merge_prefill_contents)
            seq, ctx, q = seqs[0], ctx_lens[0], query_lens[0]
            for name in names:
                cache = self.caches[self.buffer_of[name]]
                if window is None:  # full layers read every context block, the chunk causally
                    blocks = md.block_list.view(len(query_lens), -1)[0].tolist()
                    assert wkv.NULL_BLOCK_ID not in blocks[:math.ceil(ctx / BS)]
                    got = [int(cache[blocks[p // BS] * BS + p % BS]) for p in range(ctx)]
                    want = [int(self.code(name, seq.tokens, p)) for p in range(ctx)]
                    self.miss(got, want, (name, seq.rid, "context"))
                    continue
                meta = SimpleNamespace(is_prompt=True, block_list=md.block_list, window_block_list=md.window_block_list,
                                       block_size=BS, context_lens_tensor=md.context_lens_tensor,
                                       seq_lens_tensor=md.seq_lens_tensor)
                bias = self.set_window_bias(processor, meta, len(query_lens), slots.shape[1], window, "cpu",
                                            torch.float32).window_attn_bias
                wblocks = md.window_block_list.view(len(query_lens), -1)[0].tolist()
                assert wkv.NULL_BLOCK_ID not in wblocks  # the window's context blocks are all live
                key_codes = [int(cache[bid * BS + o]) if bid >= 0 else None for bid in wblocks for o in range(BS)]
                key_codes += [int(self.code(name, seq.tokens, ctx + j)) for j in range(slots.shape[1])]
                for i in range(q):
                    got = [key_codes[k] for k in range(len(key_codes)) if bias[0, 0, i, k] == 0]
                    pos = ctx + i
                    want = [int(self.code(name, seq.tokens, p)) for p in window_positions(pos, window)]
                    self.miss(got, want, (name, seq.rid, pos))


def plain(obj):
    """Records as {"type": their class name, field: value}, recursively; tensors and the rest as they are."""
    if isinstance(obj, (list, tuple)):
        return [plain(o) for o in obj]
    if dataclasses.is_dataclass(obj) or isinstance(obj, SimpleNamespace):
        return {"type": type(obj).__name__, **{k: plain(v) for k, v in vars(obj).items()}}
    return obj


def run(trees, seed: int, n_steps: int, **kw) -> Steps:
    s = Steps(trees, seed, **kw)
    for _ in range(n_steps):
        s.step()
    return s
