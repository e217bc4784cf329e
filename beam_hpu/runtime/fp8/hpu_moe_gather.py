"""Gathered per-channel FP8 MoE for a small step: read only the experts the step routes to.

A dense FP8 expert pass (vllm-gaudi's fused `mixture_of_experts` op over every local expert, or
`dense_fp8_moe` below) touches every local expert's weights each step, while T tokens route to at
most T x top_k experts. `gathered_fp8_moe` picks a static count G = min(E_local, T x top_k) of
local experts that covers every expert the step routes to on this rank, gathers their FP8
weights and per-channel scales, and computes what the dense pass computes for each (token,
expert) pair: x -> per-token FP8 (the caller's quantiser: BEAM_EXACT_ROUNDING's rounding) ->
FP8 GEMM with fp32 accumulate, scaled by token and channel scale -> SwiGLU (fp32, result in
x.dtype) -> per-token FP8 again -> down GEMM likewise -> weighted sum over experts in fp32, in
ascending expert id order, one expert after the other.

Why the result is the dense pass's, bit for bit in fp32:
- G covers every routed expert: a step has at most T x top_k distinct (token, expert) pairs.
- Gathered ids are ascending, so each token's experts are added in the dense pass's order; the
  padding experts (and routed experts of other tokens) carry a combine weight of exactly 0, and
  y * 0 is +-0, which leaves an fp32 sum unchanged.
- Each expert's GEMM runs on the same [T, H] rows with the same weights in both passes, so its
  fp32 accumulation is the same whatever the kernel's order; the per-token quantisations are
  per row.
With another GEMM kernel for the gathered rows than for the dense ones (e.g. a batched kernel
over G against a per-expert one) the sums inside a GEMM may be taken in another order: the
difference is then bounded by fp32 accumulation-order error (tests/runtime/fp8/test_hpu_moe_gather.py).

Static shapes (HPU graphs): G depends only on the bucketed T, top_k and E_local; which experts
fill the G slots is data (a top-k over per-expert hit counts), never a shape, and no branch
depends on the routing. Expert parallel: ids are this rank's local ids, -1 for another rank's
experts (they get no slot's weight); a rank with no routed expert returns exact zeros.

Used by: the CPU portable FP8 experts (beam_hpu.runtime.fp8.portable_moe, under BEAM_MOE_GATHER), and
on Gaudi the port unit beam-moe-gather in vllm-gaudi's HPUCompressedTensorsW8A8Fp8MoEMethod, with
`hpu_fp8_gemm` as the GEMM and the fused op's own activation quantiser.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from beam_hpu.model.ops import swiglu_fp32
from beam_hpu.names import MODEL_TYPE
from beam_hpu.settings import switches

Quantiser = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (x_fp8 [n, K], x_scale [n, 1], w_fp8 [N, K], w_scale [N, 1]) -> [n, N] fp32
Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------- the switch

def gather_limit(env: Mapping[str, str] | None = None) -> int:
    """BEAM_MOE_GATHER: the largest step token count that takes the gathered path (0 = off)."""
    return switches.current("BEAM_MOE_GATHER", env)


def takes_gathered_path(tokens: int, limit: int) -> bool:
    return 0 < tokens <= limit


def hpu_gather_limit(model_type: str | None, static_input_scales: bool, block_quant: bool,
                     env: Mapping[str, str] | None = None) -> int:
    """The limit a Gaudi compressed-tensors FP8 MoE layer keeps (port unit beam-moe-gather): the
    switch for a Beam layer with per-channel weights and dynamic per-token activations; 0 (the
    stock fused op always) for any other model or scheme, and where no vLLM config is current
    (model type None: the worker always loads inside one; a tool processing weights outside it
    keeps the stock op, which is right for every model, Beam included, since the switch is on by
    default and must not refuse another model's load)."""
    limit = gather_limit(env)  # read (and validated) for every model
    if model_type != MODEL_TYPE or static_input_scales or block_quant:
        return 0
    return limit


# ---------------------------------------------------------------- routing on this rank

def gathered_count(tokens: int, top_k: int, local_experts: int) -> int:
    """G: enough slots for every expert T tokens can route to, never more than the rank holds."""
    return min(local_experts, tokens * top_k)


def local_ids_from_offset(topk_ids: torch.Tensor, experts_min: int, local_experts: int) -> torch.Tensor:
    """Global ids [T, k] -> local ids on a rank holding [experts_min, experts_min + E_local) (vllm-gaudi's
    experts_min/max), -1 elsewhere."""
    local = topk_ids.long() - experts_min
    return torch.where((local >= 0) & (local < local_experts), local, torch.full_like(local, -1))


def local_ids_from_map(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Global ids [T, k] -> local ids through vLLM's expert_map (-1: another rank's expert)."""
    if expert_map is None:
        return topk_ids.long()
    return expert_map[topk_ids.long()].long()


def combine_weights(local_ids: torch.Tensor, topk_weights: torch.Tensor, local_experts: int) -> torch.Tensor:
    """[T, k] local ids and weights -> [T, E_local] fp32: each token's weight for each local expert
    (0 where the token does not route to it; other ranks' slots dropped)."""
    tokens = local_ids.shape[0]
    on_rank = local_ids >= 0
    slot = torch.where(on_rank, local_ids, torch.full_like(local_ids, local_experts))  # [T, k]; E_local = drop
    weights = torch.where(on_rank, topk_weights.float(), torch.zeros_like(topk_weights, dtype=torch.float32))
    combine = torch.zeros(tokens, local_experts + 1, dtype=torch.float32, device=local_ids.device)
    combine.scatter_add_(1, slot, weights)
    return combine[:, :local_experts]


def routed_local_experts(local_ids: torch.Tensor, local_experts: int, count: int) -> torch.Tensor:
    """[count] ascending local expert ids that include every expert `local_ids` [T, k] names.

    A top-k over per-expert hit counts: routed experts (count >= 1) come before unrouted ones
    (count 0), and there are at most T x k routed ones, so `count` = G slots hold them all."""
    hits = torch.zeros(local_experts + 1, dtype=torch.float32, device=local_ids.device)
    slot = torch.where(local_ids >= 0, local_ids, torch.full_like(local_ids, local_experts)).reshape(-1)
    hits.scatter_add_(0, slot, torch.ones(slot.shape, dtype=torch.float32, device=local_ids.device))
    chosen = torch.topk(hits[:local_experts], count, sorted=False).indices  # [G]
    return torch.sort(chosen).values


# ---------------------------------------------------------------- the expert passes

def cpu_fp8_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """[n, K] fp8 (scale [n, 1]) @ [N, K]^T fp8 (scale [N, 1]) -> [n, N] fp32: FP8 operands, fp32
    accumulate, both scales on the fp32 result (torch's CPU _scaled_mm takes scalar scales only)."""
    one = torch.ones((), dtype=torch.float32, device=x_fp8.device)
    acc = torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    return acc * x_scale.float() * w_scale.float().view(1, -1)


def hpu_fp8_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The same product on Gaudi: torch.ops.hpu.fp8_gemm_v2 with fp32 output, per-token A scale
    [n, 1] and per-channel B scale [1, N], the weight passed as its [K, N] view (the call
    vllm-gaudi's apply_fp8_linear_hpu makes for a per-channel FP8 linear)."""
    return torch.ops.hpu.fp8_gemm_v2(A=x_fp8, trans_A=False, B=w_fp8.t(), trans_B=False, D=None,
                                     out_dtype=torch.float32, A_scale_inv=x_scale,
                                     B_scale_inv=w_scale.reshape(1, -1), bias=None, accumulate=False)


def _experts(x, x_fp8, x_scale, w13, w13_scale, w2, w2_scale, combine, quantise, gemm):
    """Sum over the given experts (in order) of combine[:, e] * expert_e(x); all [T, ...]."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for e in range(w13.shape[0]):
        gate_up = gemm(x_fp8, x_scale, w13[e], w13_scale[e]).to(x.dtype)  # [T, 2I]
        a_fp8, a_scale = quantise(swiglu_fp32(gate_up))  # [T, I] fp8, [T, 1]
        y = gemm(a_fp8, a_scale, w2[e], w2_scale[e])  # [T, H] fp32
        out = out + y * combine[:, e:e + 1]
    return out.to(x.dtype)


def gathered_fp8_moe(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                     w2_scale: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor,
                     quantise: Quantiser, gemm: Gemm = cpu_fp8_gemm) -> torch.Tensor:
    """Routed experts of this rank over G gathered experts. x [T, H]; w13 [E_local, 2I, H] fp8;
    w2 [E_local, H, I] fp8; scales [E_local, rows, 1] fp32; topk_weights [T, k]; local_ids [T, k]
    (-1: another rank's). Returns this rank's partial [T, H] in x.dtype."""
    local_experts = w13.shape[0]
    count = gathered_count(x.shape[0], local_ids.shape[-1], local_experts)
    ids = routed_local_experts(local_ids, local_experts, count)  # [G]
    combine = combine_weights(local_ids, topk_weights, local_experts).index_select(1, ids)  # [T, G]
    x_fp8, x_scale = quantise(x)  # once: the same rows for every expert
    return _experts(x, x_fp8, x_scale, w13.index_select(0, ids), w13_scale.index_select(0, ids),
                    w2.index_select(0, ids), w2_scale.index_select(0, ids), combine, quantise, gemm)


def dense_fp8_moe(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor,
                  quantise: Quantiser, gemm: Gemm = cpu_fp8_gemm) -> torch.Tensor:
    """The dense pass the gathered one must equal: every local expert over every token."""
    combine = combine_weights(local_ids, topk_weights, w13.shape[0])  # [T, E_local]
    x_fp8, x_scale = quantise(x)
    return _experts(x, x_fp8, x_scale, w13, w13_scale, w2, w2_scale, combine, quantise, gemm)


def hpu_gathered_moe(layer, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     quantise: Quantiser) -> torch.Tensor:
    """The port unit beam-moe-gather's call in vllm-gaudi's HPUCompressedTensorsW8A8Fp8MoEMethod.
    apply_monolithic: the layer's loaded FP8 experts (w13 [E_local, 2I, H], scales [E_local, 2I, 1],
    as the fused op's per-expert views see them), ids offset by the op's experts_min, the op's
    own activation quantiser, fp8_gemm_v2. x [T, H]; returns [T, H] in x.dtype."""
    local_ids = local_ids_from_offset(topk_ids, layer.moe_op.experts_min, layer.w13_weight.shape[0])
    return gathered_fp8_moe(x, layer.w13_weight, layer.w13_weight_scale, layer.w2_weight, layer.w2_weight_scale,
                            topk_weights, local_ids, quantise, hpu_fp8_gemm)
