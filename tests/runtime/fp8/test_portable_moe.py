"""The portable FP8 expert path: FP8 numerics, and expert-parallel id remapping."""

import pytest
import torch
import torch.nn.functional as F

from beam_hpu.runtime.fp8.portable_moe import fp8_experts_forward, local_expert_ids
from beam_hpu.reference.in_memory import fake_quant_per_token
from tests.support.moe_weights import FP8, E, H, I, K, T, fp8_weights


def quant_per_token(x):
    """Per-token FP8 as (fp8 values, fp32 scale [T, 1]): absmax onto 448."""
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 448.0
    return (x.float() / scale).clamp(-448, 448).to(FP8), scale


@pytest.fixture
def moe():
    g = torch.Generator().manual_seed(0)
    w13, s13 = fp8_weights(g, 2 * I, H)
    w2, s2 = fp8_weights(g, H, I)
    x = torch.randn(T, H, generator=g)
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    topk_weights = torch.rand(T, K, generator=g)
    return x, w13, s13, w2, s2, topk_weights, topk_ids


def expected(x, w13, s13, w2, s2, topk_weights, topk_ids):
    """Independent statement: dequantised weights, inputs rounded per token, fp32 math, per token."""
    out = torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            e = topk_ids[t, k].item()
            gate, up = F.linear(fake_quant_per_token(x[t:t + 1]), w13[e].float() * s13[e]).chunk(2, dim=-1)
            act = F.silu(gate) * up
            out[t] += topk_weights[t, k] * F.linear(fake_quant_per_token(act), w2[e].float() * s2[e])[0]
    return out


def test_fp8_experts_match_per_token_fp8_math(moe):
    ours = fp8_experts_forward(*moe, expert_map=None, quant_per_token=quant_per_token)
    torch.testing.assert_close(ours, expected(*moe), rtol=1e-4, atol=1e-5)


def test_activation_rounding_is_not_skipped(moe):
    no_rounding = lambda x: (x.float(), torch.ones(x.shape[0], 1))  # noqa: E731
    with pytest.raises(ValueError, match="float8"):  # FP8 operands only: no silent upcast path
        fp8_experts_forward(*moe, expert_map=None, quant_per_token=no_rounding)


def split_experts(moe, rank, world):
    """Rank `rank` of `world` under linear placement: its weight rows and its expert_map."""
    x, w13, s13, w2, s2, topk_weights, topk_ids = moe
    per = E // world
    lo, hi = rank * per, (rank + 1) * per
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    expert_map[lo:hi] = torch.arange(per, dtype=torch.int32)
    return (x, w13[lo:hi], s13[lo:hi], w2[lo:hi], s2[lo:hi], topk_weights, topk_ids), expert_map


def test_expert_parallel_ranks_sum_to_the_single_rank_result(moe):
    whole = fp8_experts_forward(*moe, expert_map=None, quant_per_token=quant_per_token)
    parts = [fp8_experts_forward(*args, expert_map=m, quant_per_token=quant_per_token)
             for args, m in (split_experts(moe, r, 2) for r in range(2))]
    assert all(p.abs().sum() > 0 for p in parts)  # both ranks hold routed experts
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-6, atol=1e-6)


def test_wrong_expert_map_changes_the_result(moe):
    whole = fp8_experts_forward(*moe, expert_map=None, quant_per_token=quant_per_token)
    parts = []
    for r in range(2):
        args, m = split_experts(moe, r, 2)
        parts.append(fp8_experts_forward(*args, expert_map=m.roll(1), quant_per_token=quant_per_token))
    assert (parts[0] + parts[1] - whole).abs().max() > 1e-2


def test_local_expert_ids():
    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    ids = torch.tensor([[0, 2], [3, 1]], dtype=torch.int64)
    assert local_expert_ids(ids, expert_map).tolist() == [[-1, 0], [1, -1]]
    assert local_expert_ids(ids, expert_map).dtype == ids.dtype
    assert local_expert_ids(ids, None) is ids
