"""The DFlash2 drafter's context, kept per request by the proposer: plain torch.

A DFlash2 block (the bonus token and the mask tokens) attends to keys and values made from the
target's hidden states at the tokens already accepted. vLLM 0.30.0's V1 DFlash proposer writes
them into vLLM's paged KV cache through a Triton kernel; the Beam drafter
(beam_hpu.model.dflash2) takes them as an explicit input instead, so the proposer keeps them
here: per request, ordered by position, cut to what the drafter's sliding window lets the next
block see. Shapes: L drafter layers, C context rows, Nkv KV heads, D head_dim, R requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RequestContext:
    positions: torch.Tensor  # [C] int64, increasing
    keys: torch.Tensor  # [L, C, Nkv, D]
    values: torch.Tensor  # [L, C, Nkv, D]

    @property
    def last_position(self) -> int:
        return int(self.positions[-1])


def extend(old: RequestContext | None, positions: torch.Tensor, keys: torch.Tensor,
           values: torch.Tensor, window: int | None) -> RequestContext:
    """`old` with the rows of one step appended (positions [n] increasing, keys/values [L, n, ...]).

    Rows of `old` at or past the first new position go first: the proposer never stores a rejected
    draft, but a request that was preempted recomputes from an earlier position. Then rows the next
    block cannot see go: its first row sits at last + 1 and sees position j when
    (last + 1) - j < window, and its later rows see less of the past.
    """
    if old is not None:
        # rows are ordered by position: a count says which stay (no mask gather when all stay)
        kept = int(torch.searchsorted(old.positions, positions[:1]))
        positions = torch.cat([old.positions[:kept], positions])
        keys = torch.cat([old.keys[:, :kept], keys], dim=1)
        values = torch.cat([old.values[:, :kept], values], dim=1)
    if window is not None:
        gone = int(torch.searchsorted(positions, positions[-1:] + 2 - window))  # rows at <= last + 1 - window
        if gone:
            positions, keys, values = positions[gone:], keys[:, gone:], values[:, gone:]
    return RequestContext(positions, keys, values)


def batch(contexts: list[RequestContext]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One padded batch: keys, values [L, R, C, Nkv, D] (C the longest), positions [R, C] and
    valid [R, C] (False on padding rows, which the drafter's attention masks out)."""
    first = contexts[0]
    if len(contexts) == 1:  # nothing to pad
        valid = torch.ones_like(first.positions, dtype=torch.bool)
        return first.keys[:, None], first.values[:, None], first.positions[None], valid[None]
    width = max(c.positions.shape[0] for c in contexts)
    L, _, nkv, d = first.keys.shape
    R = len(contexts)
    keys = first.keys.new_zeros(L, R, width, nkv, d)
    values = first.values.new_zeros(L, R, width, nkv, d)
    positions = torch.zeros(R, width, dtype=torch.long, device=first.positions.device)
    valid = torch.zeros(R, width, dtype=torch.bool, device=first.positions.device)
    for r, c in enumerate(contexts):
        n = c.positions.shape[0]
        keys[:, r, :n], values[:, r, :n] = c.keys, c.values
        positions[r, :n], valid[r, :n] = c.positions, True
    return keys, values, positions, valid


def block_inputs(bonus_ids: torch.Tensor, last_positions: torch.Tensor, block: int, mask_token_id: int,
                 max_model_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block of each request: ids [R, block] (the bonus token, then mask tokens), positions
    [R, block] from last + 1 on (the bonus token follows the last accepted token), and in_range
    [R, block]: the rows below max_model_len.

    Near the end of the model length a block reaches past it: the drafts there are dropped by the
    scheduler (a request has no room for them), but their rows still run. Such a row takes
    position max_model_len - 1 (the drafter's RoPE table ends at its max_position_embeddings,
    which may be the model length: vLLM's native RoPE raises on an index past it, vLLM-CPU's
    rotary kernel and a card's read past the table's end unchecked) and is no key for the other rows (`DFlash2Context.block_valid`), so the rows
    that can still be accepted draft from their own positions and the context only.
    """
    R = bonus_ids.shape[0]
    ids = torch.full((R, block), mask_token_id, dtype=torch.long, device=bonus_ids.device)
    ids[:, 0] = bonus_ids.long()
    offsets = torch.arange(1, block + 1, device=last_positions.device)
    positions = last_positions.long()[:, None] + offsets[None]
    in_range = positions < max_model_len
    return ids, positions.clamp(max=max_model_len - 1), in_range
