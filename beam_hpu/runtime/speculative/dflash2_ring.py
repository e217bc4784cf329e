"""The DFlash2 drafter's context with static shapes: one ring of the drafter's window per request.

On a card every device op of a drafting step must have the same shapes from step to step (one
compiled graph per (batch bucket, block)), so the per-request lists of `dflash2_context` (which
grow, shrink and are cut on the host) become fixed buffers: each request owns a slot of W rows (W
the drafter's window), position p lives in row p % W of its slot, and a row remembers its
position. A write never needs to know what the slot held: the newest W positions of a request
are exactly the rows a block can see, and a block's attention reads only the rows at or before
the last accepted position (rows of a preempted request's later positions, or of the slot's
previous owner, stay masked until they are rewritten). Rows that carry nothing (padding of a
bucket, rejected drafts, prompt rows older than the window) are written to the spare slot S,
which no request owns. Shapes: L drafter layers, S slots, W window, Nkv KV heads, D head_dim,
R rows of a batch, T rows per request in one write.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from beam_hpu.model.dflash2 import DFlash2Context


class ContextRing(nn.Module):
    """Buffers (moved and captured with the drafting step that owns them): keys, values [L, S + 1,
    W, Nkv, D] and positions [S + 1, W] (-1: empty)."""

    def __init__(self, layers: int, slots: int, window: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.window, self.spare = window, slots
        keys = torch.zeros(layers, slots + 1, window, kv_heads, head_dim, dtype=dtype, device=device)
        self.register_buffer("keys", keys, persistent=False)
        self.register_buffer("values", torch.zeros_like(keys), persistent=False)
        self.register_buffer("positions", torch.full((slots + 1, window), -1, dtype=torch.long, device=device),
                             persistent=False)

    def clear(self, slot: torch.Tensor) -> None:
        """Forget what slot [1] held (a new request takes it): its rows read as empty."""
        self.positions.index_fill_(0, slot, -1)

    def write(self, slots: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              valid: torch.Tensor) -> None:
        """Store one step's rows: slots [R], positions [R, T], keys/values [L, R * T, Nkv, D], valid
        [R, T]. A request's valid rows older than W before its newest are not stored (they would
        share a ring row with a newer one; no block can see them)."""
        R, T = positions.shape
        newest = torch.where(valid, positions, -1).amax(dim=1, keepdim=True)  # [R, 1]
        kept = valid & (positions > newest - self.window)
        row = torch.where(kept, slots[:, None] * self.window + positions.remainder(self.window),
                          self.spare * self.window + torch.arange(T, device=positions.device).remainder(self.window))
        row = row.reshape(-1)  # [R * T]
        L = self.keys.shape[0]
        self.keys.view(L, -1, *self.keys.shape[3:]).index_copy_(1, row, keys.to(self.keys.dtype))
        self.values.view(L, -1, *self.values.shape[3:]).index_copy_(1, row, values.to(self.values.dtype))
        self.positions.view(-1).index_copy_(0, row, torch.where(kept, positions, -1).reshape(-1))

    def context(self, slots: torch.Tensor, last: torch.Tensor, block_valid: torch.Tensor) -> DFlash2Context:
        """What the blocks of requests in slots [R] read, each up to its last accepted position
        last [R]: keys/values [L, R, W, Nkv, D], positions and valid [R, W]."""
        positions = self.positions.index_select(0, slots)
        valid = (positions >= 0) & (positions <= last[:, None])
        return DFlash2Context(self.keys.index_select(1, slots), self.values.index_select(1, slots), positions,
                              valid, block_valid)


class SlotTable:
    """Which request owns which slot of the ring (host side; S slots, the runner's max_num_seqs).

    A request keeps its slot while the runner keeps it (`runner.requests`), preempted or not, so a
    resumed request drafts from its context again. The runner can hold more requests than it runs
    at once (preempted ones wait beside new ones): when no slot is free, the one used least
    recently by a request outside the current step is taken; that request's context starts over
    if it comes back (drafts get worse for a while, answers do not change)."""

    def __init__(self, slots: int) -> None:
        self.spare = slots
        self.free = list(range(slots - 1, -1, -1))
        self.owner: OrderedDict[str, int] = OrderedDict()  # least recently used first

    def release_absent(self, live: set[str]) -> None:
        for req_id in [r for r in self.owner if r not in live]:
            self.free.append(self.owner.pop(req_id))

    def assign(self, req_ids: list[str | None]) -> tuple[list[int], list[int]]:
        """(slot of each request, None -> the spare; slots newly taken, to be cleared)."""
        step = {r for r in req_ids if r is not None}
        if len(step) > self.spare:
            raise RuntimeError(f"DFlash2 drafter: {len(step)} requests in one drafting step, more than the "
                               f"{self.spare} context slots (max_num_seqs)")
        slots, new = [], []
        for req_id in req_ids:
            if req_id is None:
                slots.append(self.spare)
                continue
            if req_id not in self.owner:
                if not self.free:
                    idle = next(r for r in self.owner if r not in step)
                    self.free.append(self.owner.pop(idle))
                self.owner[req_id] = self.free.pop()
                new.append(self.owner[req_id])
            self.owner.move_to_end(req_id)
            slots.append(self.owner[req_id])
        return slots, new
