"""The DFlash2 drafter's context across prefix-cache hits (CPU proposer).

A request whose prompt starts with blocks vLLM's prefix cache holds gets no target states for
them: the target computes only the rest. The drafter's context (its K/V over the target's states,
`dflash2_context`) would start there, and the request would draft as if it had no past; in
multi-turn chat every turn after the first is such a request.

So the proposer keeps the context rows of every full KV block it has seen, keyed as vLLM keys the
block: a hash chained over every token up to the block's end (vLLM adds LoRA, multimodal and
cache-salt keys: the Beam port serves none that change the target's states, and the same tokens give
the same states). A request that starts past 0 takes back the rows of the blocks before its first
position that the window still shows, found by the same keys. Bounded by the target's KV cache
blocks (a hit cannot reach further back than the cache holds), least recently used first out.

Plain torch and hashlib: nothing here imports vLLM.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from beam_hpu.runtime.speculative.dflash2_context import RequestContext


def block_keys(tokens: list[int], block_size: int, known: list[bytes] | None = None) -> list[bytes]:
    """The chained key of every full block of `tokens` (block b's covers tokens[: (b + 1) * bs]);
    `known`, the keys of a prefix of the same tokens, is extended instead of recomputed."""
    keys = list(known or [])
    parent = keys[-1] if keys else b""
    for b in range(len(keys), len(tokens) // block_size):
        chunk = torch.tensor(tokens[b * block_size:(b + 1) * block_size], dtype=torch.int64).numpy().tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        keys.append(parent)
    return keys


@dataclass
class RequestTokens:
    """A request's token ids at positions 0.. its last accepted one, and their block keys."""

    tokens: list[int]
    keys: list[bytes] = field(default_factory=list)

    def rewind_and_append(self, first: int, ids: list[int], block_size: int) -> None:
        """Tokens from position `first` on replaced by `ids` (a preempted request recomputes)."""
        del self.tokens[first:]
        del self.keys[first // block_size:]
        self.tokens.extend(ids)
        self.keys = block_keys(self.tokens, block_size, self.keys)


class PrefixContexts:
    """Context rows [L, block_size, Nkv, D] (keys and values) by block key."""

    def __init__(self, block_size: int, max_blocks: int) -> None:
        self.block_size, self.max_blocks = block_size, max_blocks
        self.blocks: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def keep(self, keys: list[bytes], ctx: RequestContext) -> None:
        """Store the rows of every full block `ctx` holds whole (its positions are increasing and
        contiguous from its first), by the request's block `keys`."""
        bs = self.block_size
        if ctx.positions.numel() == 0:
            return
        first, last = int(ctx.positions[0]), int(ctx.positions[-1])
        for b in range(-(-first // bs), min((last + 1) // bs, len(keys))):
            if keys[b] in self.blocks:
                self.blocks.move_to_end(keys[b])
                continue
            rows = slice(b * bs - first, (b + 1) * bs - first)
            if not torch.equal(ctx.positions[rows].cpu(), torch.arange(b * bs, (b + 1) * bs)):
                continue  # a hole in the context (rows it never had): the block is not whole here
            self.blocks[keys[b]] = (ctx.keys[:, rows].clone(), ctx.values[:, rows].clone())
            if len(self.blocks) > self.max_blocks:
                self.blocks.popitem(last=False)

    def restore(self, keys: list[bytes], start: int, window: int | None) -> RequestContext | None:
        """The context rows before position `start` that the window can still show, from the
        stored blocks ending with the one holding position start - 1 (back to the first miss)."""
        bs = self.block_size
        last_block = (start - 1) // bs
        if start <= 0 or last_block >= len(keys):
            return None
        oldest = 0 if window is None else max(0, start - window) // bs
        found = []
        for b in range(last_block, oldest - 1, -1):
            rows = self.blocks.get(keys[b])
            if rows is None:
                break
            self.blocks.move_to_end(keys[b])
            found.append(rows)
        if not found:
            return None
        found.reverse()
        first = (last_block - len(found) + 1) * bs
        k = torch.cat([f[0] for f in found], dim=1)[:, :start - first]
        v = torch.cat([f[1] for f in found], dim=1)[:, :start - first]
        return RequestContext(torch.arange(first, start, device=k.device), k, v)
