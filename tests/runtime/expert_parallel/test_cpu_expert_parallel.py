"""CPU expert parallel: global top-k ids remapped through expert_map before vLLM-CPU's expert kernel.

The kernel runs for real here (`cpu_fused_moe` on prepacked weights, as CPUUnquantizedExperts
calls it): two ranks, each with half the experts, must sum to the single-rank result.
"""

import pytest
import torch

from beam_hpu.runtime.expert_parallel.cpu_expert_parallel import remap_topk_to_local
from beam_hpu.runtime.expert_parallel.patch_cpu_expert_parallel import _apply_with_expert_map

E, H, I, T, K = 8, 64, 32, 11, 2


def linear_map(rank: int, world: int, num_experts: int = E) -> torch.Tensor:
    """vLLM's linear placement: rank r holds experts [r*E/w, (r+1)*E/w)."""
    per = num_experts // world
    m = torch.full((num_experts,), -1, dtype=torch.int32)
    m[rank * per:(rank + 1) * per] = torch.arange(per, dtype=torch.int32)
    return m


def test_remap_points_other_ranks_experts_at_slot_0_with_weight_0():
    ids = torch.tensor([[0, 5], [7, 4], [2, 3]], dtype=torch.int32)
    w = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    local, lw = remap_topk_to_local(ids, w, linear_map(1, 2))
    assert local.tolist() == [[0, 1], [3, 0], [0, 0]]
    assert torch.equal(lw, torch.tensor([[0.0, 0.4], [0.7, 0.3], [0.0, 0.0]]))
    assert (local.dtype, lw.dtype) == (ids.dtype, w.dtype)
    local0, lw0 = remap_topk_to_local(ids, w, linear_map(0, 2))
    assert local0.tolist() == [[0, 0], [0, 0], [2, 3]]
    assert torch.equal(lw0, torch.tensor([[0.6, 0.0], [0.0, 0.0], [0.5, 0.5]]))
    assert torch.equal(w, torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]]))  # inputs untouched


def kernel_moe(dtype):
    """The real vLLM-CPU unquantised expert kernel, as CPUUnquantizedExperts drives it."""
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    def run(x, w13, w2, topk_weights, topk_ids):
        out = torch.empty_like(x)
        cpu_fused_moe(out, x, cpu_prepack_moe_weight(w13.contiguous(), "vec"),
                      cpu_prepack_moe_weight(w2.contiguous(), "vec"), None, None, topk_weights, topk_ids,
                      "silu", "vec")
        return out

    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * I**-0.5).to(dtype)
    x = torch.randn(T, H, generator=g).to(dtype)
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    topk_weights = torch.rand(T, K, generator=g)
    return run, x, w13, w2, topk_weights, topk_ids


def ranks_output(run, x, w13, w2, topk_weights, topk_ids, maps):
    per = E // len(maps)
    parts = []
    for r, m in enumerate(maps):
        ids, w = remap_topk_to_local(topk_ids, topk_weights, m)
        parts.append(run(x, w13[r * per:(r + 1) * per], w2[r * per:(r + 1) * per], w, ids).float())
    return parts


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_ranks_sum_to_the_single_rank_result(dtype, tol):
    run, x, w13, w2, topk_weights, topk_ids = kernel_moe(dtype)
    whole = run(x, w13, w2, topk_weights, topk_ids).float()
    parts = ranks_output(run, x, w13, w2, topk_weights, topk_ids, [linear_map(r, 2) for r in range(2)])
    assert all(p.abs().sum() > 0 for p in parts)  # both ranks computed routed experts
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=tol, atol=tol)


@pytest.mark.parametrize("wrong", ["rolled", "unmapped"])
def test_kernel_result_changes_when_an_expert_is_mapped_wrongly(wrong):
    run, x, w13, w2, topk_weights, topk_ids = kernel_moe(torch.float32)
    whole = run(x, w13, w2, topk_weights, topk_ids)
    maps = [linear_map(r, 2) for r in range(2)]
    if wrong == "rolled":
        maps[1] = maps[1].roll(1)  # rank 1 sends expert 4 to local slot 3 (=global 7), and so on
    else:
        maps[0] = torch.where(torch.arange(E) == 2, -1, maps[0]).to(torch.int32)  # expert 2 owned by nobody
    parts = ranks_output(run, x, w13, w2, topk_weights, topk_ids, maps)
    assert (parts[0] + parts[1] - whole).abs().max() > 1e-2


def test_wrapper_remaps_only_under_expert_parallel():
    calls = []

    def stock_apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                    expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                    apply_router_weight_on_input):
        calls.append((topk_ids.clone(), topk_weights.clone()))

    apply = _apply_with_expert_map(stock_apply)
    ids, w = torch.tensor([[0, 5]], dtype=torch.int32), torch.tensor([[0.6, 0.4]])
    common = dict(output=None, hidden_states=None, w1=None, w2=None, activation="silu", global_num_experts=E,
                  a1q_scale=None, a2_scale=None, workspace13=None, workspace2=None, expert_tokens_meta=None)
    apply(object(), topk_weights=w, topk_ids=ids, expert_map=None, apply_router_weight_on_input=False, **common)
    apply(object(), topk_weights=w, topk_ids=ids, expert_map=linear_map(1, 2), apply_router_weight_on_input=False,
          **common)
    assert calls[0][0].tolist() == [[0, 5]] and torch.equal(calls[0][1], w)
    assert calls[1][0].tolist() == [[0, 1]] and torch.equal(calls[1][1], torch.tensor([[0.0, 0.4]]))
    with pytest.raises(NotImplementedError, match="apply_router_weight_on_input"):
        apply(object(), topk_weights=w, topk_ids=ids, expert_map=linear_map(1, 2),
              apply_router_weight_on_input=True, **common)
