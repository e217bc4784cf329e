"""vLLM's own KVCacheManager over Beam's KV-cache groups, with the device buffers as a window-sized
cache lays them out: one buffer per group position j, shared by the j-th layer of every group
(window_kv.shared_buffer_layers), plus the runner's pad block. Each slot holds the code of the
key written there, from a code book of key identities (layer, position, tokens through it: what
the K/V depends on); 0 is a slot nothing wrote.

The window-KV tests (rules and tree runs) drive requests through the manager, write keys where
the thing under test says, read them back where it says, and count the reads that differ from
the exact-window definition (`miss`)."""
from __future__ import annotations

import torch

from beam_hpu.runtime.window_kv import groups as wkv


class KVPool:
    def __init__(self, kc, block_size: int, num_blocks: int, *, max_model_len: int, caching: bool):
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        self.kc, self.bs = kc, block_size
        self.groups = [g.layer_names for g in kc.kv_cache_groups]
        self.windows = [getattr(g.kv_cache_spec, "sliding_window", None) for g in kc.kv_cache_groups]
        self.hasher = None
        if caching:
            init_none_hash(sha256)
            self.hasher = get_request_block_hasher(block_size, sha256)
        self.manager = KVCacheManager(kc, max_model_len=max_model_len, scheduler_block_size=block_size,
                                      hash_block_size=block_size, enable_caching=caching)
        buffers = wkv.shared_buffer_layers(self.groups)
        self.buffer_of = {name: j for j, names in enumerate(buffers) for name in names}
        self.caches = [torch.zeros((num_blocks + 1) * block_size) for _ in buffers]
        self.codes: dict[tuple, int] = {}
        self.rows_checked = self.mismatches = self.null_columns = self.reused = 0
        self.first_mismatch = None  # (where, keys read, keys wanted), each key as (layer, position)
        self.owner: dict[int, tuple] = {}  # block id -> (group, request) that last held it

    def code(self, layer: str, tokens: list[int], pos: int) -> float:
        return float(self.codes.setdefault((layer, pos, tuple(tokens[:pos + 1])), len(self.codes) + 1))

    def cache(self, layer: str) -> torch.Tensor:
        return self.caches[self.buffer_of[layer]]

    def write_slots(self, layer: str, slots, tokens: list[int], positions) -> None:
        """The keys of `tokens` at `positions` written to `slots` of the layer's buffer by hand."""
        for pos, slot in zip(positions, slots):
            self.cache(layer)[slot] = self.code(layer, tokens, pos)

    def track(self, rids: list[str], tables: list[list[list[int]]]) -> None:
        """Count freed columns and block ids that changed owner in `tables[g][b]` (request rids[b])."""
        for g, rows in enumerate(tables):
            for rid, row in zip(rids, rows):
                self.null_columns += wkv.NULL_BLOCK_ID in row
                for b in row:
                    if b != wkv.NULL_BLOCK_ID and self.owner.setdefault(b, (g, rid)) != (g, rid):
                        self.owner[b] = (g, rid)
                        self.reused += 1

    def miss(self, got, want, where) -> None:
        """One row's read: counted, and a mismatch (the first one kept) unless it is `want`."""
        self.rows_checked += 1
        if sorted(got) != sorted(want):
            self.mismatches += 1
            if self.first_mismatch is None:
                inv = {v: k[:2] for k, v in self.codes.items()}
                self.first_mismatch = (where, [inv.get(x) for x in sorted(got)], [inv.get(x) for x in sorted(want)])
