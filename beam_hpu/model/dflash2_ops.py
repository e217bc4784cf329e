"""DFlash2's block arithmetic as plain torch (no Triton): what the drafter model calls, and what a
static-shape (Gaudi) drafter step can call unchanged.

Every function works on whole blocks: R requests, each with one query block of B rows (row 0 the
bonus token, rows 1..B-1 the mask tokens), so nothing depends on how rows are flattened. Shapes:
H = hidden, G = conv groups, Nq / Nkv = query / KV heads, D = head_dim, C = context slots per
request, K = selector top-k, N = B - 1 drafted positions, V = vocabulary, r = selector rank.

Sources of the equations (the module docstring of beam_hpu/model/dflash2.py lists the rest):
- grouped convolution: vLLM 0.34's `qwen3_dflash2._grouped_conv` (CPU path) and
  `beam/nvidia/dflash2_conv_ops.py` (facts only), as published by NeMo AutoModel's DFlash2 docs
  ("Conv(x)_t = k_{t,0} x_t + k_{t,1} x_{t-1}; each coefficient a learned base kernel plus a
  correction predicted from the current hidden state, shared across conv_group_size channels;
  taps never cross a draft-block boundary, block position 0 reads zero padding");
- selector score S_t(a, b) = U_t(b) + <A(a) * H(h_t), B(b)> (NeMo AutoModel and vLLM speculators
  docs; vLLM 0.34 `_score_edges_reference`): the predecessor of the first drafted position is the
  anchor (the bonus token), later ones the candidates one position back;
- the walk: vLLM 0.34 `dflash2/speculator.py` `_selector_walk_kernel`: start at predecessor row 0,
  pick a candidate, continue from that candidate's row;
- block attention: non-causal inside the block (`is_causal` false, every layer
  `sliding_attention`, vLLM 0.34 `DFlash2BeamAttention`); the window is vLLM 0.30's non-causal
  sliding window (`flash_attn._maybe_symmetrize_window`: (W-1, 0) becomes (W-1, W-1)), i.e. a
  key at position j is seen from position i when |i - j| < W.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """One side of DFlash2's dynamic grouped convolution, within each block.

    x [R, B, H]; base [taps, H] (learned per channel); delta [R, B, taps, G] (predicted per row,
    shared by the H / G channels of a group). out[b] = sum_t (base[t] + delta[b, t]) * x[b - t],
    with x[b - t] = 0 when b < t (no tap reaches across the block start). Accumulates in fp32.
    """
    taps, H = base.shape
    R, B, _, G = delta.shape
    # channel c is in group c // (H / G): the group's coefficient broadcast over its channels
    coeff = (base.float().view(taps, G, H // G) + delta.float()[..., None]).view(R, B, taps, H)
    xf = x.float()
    out = coeff[:, :, 0] * xf
    for t in range(1, taps):
        shifted = F.pad(xf[:, :-t], (0, 0, t, 0))  # [R, B, H]: row b holds x[b - t], zeros above
        out = out + coeff[:, :, t] * shifted
    return out.to(x.dtype)


def block_mask(q_pos: torch.Tensor, ctx_pos: torch.Tensor, ctx_valid: torch.Tensor, window: int | None,
               block_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys each block row sees, [R, B, C+B] bool (keys: the context, then the block's own
    rows), the same in every layer. q_pos [R, B]; ctx_pos [R, C]; ctx_valid [R, C] (padding slots
    False); block_valid [R, B] or None (all True): a block row that is False is no key for the
    others (a row past the model length). Non-causal; with a window, key j is seen from row i when
    |pos_i - pos_j| < window."""
    key_pos = torch.cat([ctx_pos, q_pos], dim=1)  # [R, C+B]
    own = torch.ones_like(q_pos, dtype=torch.bool) if block_valid is None else block_valid
    seen = torch.cat([ctx_valid, own], dim=1)[:, None, :]  # [R, 1, C+B]
    if window is None:
        return seen.expand(-1, q_pos.shape[1], -1)
    gap = q_pos[:, :, None] - key_pos[:, None, :]  # [R, B, C+B]
    return seen & (gap < window) & (gap > -window)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                    seen: torch.Tensor, scale: float) -> torch.Tensor:
    """Non-causal attention of each query block over its context and over the whole block.

    q [R, B, Nq, D]; k, v [R, B, Nkv, D] (the block's own keys); ctx_k, ctx_v [R, C, Nkv, D];
    seen [R, B, C+B] (`block_mask`). Returns [R, B, Nq, D]. Query head h reads KV head
    h // (Nq / Nkv). Softmax in fp32.
    """
    R, B, Nq, D = q.shape
    Nkv = k.shape[2]
    keys = torch.cat([ctx_k, k], dim=1).float()  # [R, C+B, Nkv, D]
    values = torch.cat([ctx_v, v], dim=1).float()
    grouped = q.float().view(R, B, Nkv, Nq // Nkv, D)  # the query heads of each KV head together
    scores = torch.einsum("rbkgd,rjkd->rkgbj", grouped, keys) * scale  # [R, Nkv, Nq / Nkv, B, C+B]
    scores = scores.masked_fill(~seen[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("rkgbj,rjkd->rbkgd", probs, values).reshape(R, B, Nq, D).to(q.dtype)


def score_edges(
    predecessor_codebook: torch.Tensor,
    successor_codebook: torch.Tensor,
    candidate_ids: torch.Tensor,
    unary: torch.Tensor,
    hidden_rank: torch.Tensor,
    anchor_ids: torch.Tensor,
) -> torch.Tensor:
    """The selector's edge scores [R, N, K (predecessor a), K (candidate b)], fp32.

    codebooks [V, r]; candidate_ids, unary [R, N, K] (top-k ids and their soft-capped logits);
    hidden_rank [R, N, r] (hidden_projection of the drafted rows); anchor_ids [R]. Score of
    candidate b after predecessor a at position t: unary[t, b] + sum_r A[a, r] H[t, r] B[b, r].
    """
    R, N, K = candidate_ids.shape
    anchors = anchor_ids.clamp(0, predecessor_codebook.shape[0] - 1)
    pred_ids = torch.cat([anchors[:, None, None].expand(R, 1, K), candidate_ids[:, :-1]], dim=1)  # [R, N, K]
    pred = predecessor_codebook[pred_ids].float() * hidden_rank.float()[:, :, None]  # [R, N, K, r]
    succ = successor_codebook[candidate_ids].float()  # [R, N, K, r]
    return unary.float()[:, :, None, :] + torch.einsum("xnac,xnbc->xnab", pred, succ)


def greedy_walk(scores: torch.Tensor, candidate_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The selector's path at temperature 0: tokens [R, N] and the score rows it read [R, N, K].

    Position 0 reads row 0 (every predecessor there is the anchor); position t reads the row of
    the candidate chosen at t - 1. The rows are the draft's logits over its K candidates (what a
    sampled walk would draw from and rejection sampling would check against). Every row's best
    candidate is found at once; the walk only follows them (one small gather a position).
    """
    R, N, K = candidate_ids.shape
    best = scores.argmax(dim=-1)  # [R, N, K]: the best candidate after each predecessor
    read = torch.zeros(R, N, dtype=torch.long, device=scores.device)  # the predecessor row read at t
    for t in range(1, N):
        read[:, t] = best[:, t - 1].gather(1, read[:, t - 1:t])[:, 0]
    picks = best.gather(2, read[:, :, None])  # [R, N, 1]
    rows = scores.gather(2, read[:, :, None, None].expand(R, N, 1, K))[:, :, 0]
    return candidate_ids.gather(2, picks)[:, :, 0], rows


GREEDY_BELOW = 1e-5  # vLLM's sampling epsilon: a temperature below it samples greedily


def exponential_noise(requests: int, positions: int, candidates: int,
                      generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Exp(1) draws [R, N, K] for `sampled_walk`: a seeded request's (row i of `generators`) from
    its own generator, so its drafts repeat with its seed; the others' from torch's."""
    noise = torch.empty(requests, positions, candidates).exponential_()
    for i, generator in generators.items():
        if i < requests:
            noise[i].exponential_(generator=generator)
    return noise


def sampled_walk(scores: torch.Tensor, candidate_ids: torch.Tensor, temperature: torch.Tensor,
                 noise: torch.Tensor, greedy_below: float = GREEDY_BELOW) -> tuple[torch.Tensor, torch.Tensor]:
    """The selector's path sampled (upstream's `draft_sample_method: probabilistic`): tokens [R, N]
    and the distribution each was drawn from over its K candidates [R, N, K].

    At each position the request's row of edge scores (as in `greedy_walk`) at its temperature
    [R] gives softmax(row / T); the candidate is drawn from it by the exponential race (argmax of
    p / E with E ~ Exp(1), `noise` [R, N, K]: the caller draws it, per request when seeded), and
    the next position reads the drawn candidate's row. The drafted token's probability is this
    chain's, which is what rejection sampling must divide by. A request below `greedy_below`
    (vLLM's sampling epsilon) walks greedily, its rows one-hot at the pick.
    """
    R, N, K = candidate_ids.shape
    greedy = temperature < greedy_below
    inv_t = torch.where(greedy, 1.0, temperature.float()).reciprocal()[:, None]  # [R, 1]
    prev = torch.zeros(R, dtype=torch.long, device=scores.device)
    batch = torch.arange(R, device=scores.device)
    tokens, dists = [], []
    for t in range(N):
        row = scores[batch, t, prev].float()  # [R, K]
        probs = (row * inv_t).softmax(dim=-1)
        pick = torch.where(greedy, row.argmax(dim=-1), (probs / noise[:, t]).argmax(dim=-1))
        probs = torch.where(greedy[:, None], torch.nn.functional.one_hot(pick, K).float(), probs)
        tokens.append(candidate_ids[batch, t, pick])
        dists.append(probs)
        prev = pick
    return torch.stack(tokens, dim=1), torch.stack(dists, dim=1)
