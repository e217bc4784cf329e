"""Stand-ins for the Habana ops the tree tests run (FP8 casts and GEMMs, the fused MoE, RoPE,
RMSNorm), each after Habana's own public source (HabanaAI/gaudi-pytorch-bridge), cited per op.
Written here from those sources, not from the code under test: a tree test that compared a port
unit with a stand-in doing the unit's own arithmetic would prove nothing. Our model of the kernels
all the same: nothing here ran on a card.

The card computes float64 as fp32 (the bridge's getInternalDtype); the stand-ins do the same for
any float64 input. Where a stand-in accumulates in float64 it does so to be exact (e4m3 products
and their sums over these widths are exact numbers), assuming no summation order, not to model
the card.
"""
from __future__ import annotations

import enum

import torch

# tests/pytest_working/compile/test_hpu_fp8_ops.py::test_fp8_gemm_v2 accepts a card result within
# 15 % of the unquantised product (the integer part of the percentage error at most 15).
FP8_GEMM_V2_RELATIVE_TOLERANCE = 0.15


def _card_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float64 else dtype


def cast_to_fp8_v2(x, scale, fp8_max: float, dtype=torch.float8_e4m3fn):
    """tests/pytest_working/compile/test_hpu_fp8_ops.py::test_cast_to_fp8_v2 (non-stochastic):
    the card's output equals the FP8 rounding of `input * scale.to(input.dtype)`, the product
    taken in the input's own dtype. Saturated at the device's range (vllm-gaudi's FP8_MAX)."""
    in_dtype = _card_dtype(x.dtype)
    product = x.to(in_dtype) * torch.as_tensor(scale).to(in_dtype)
    return product.to(torch.float32).clamp(-fp8_max, fp8_max).to(dtype)


def fp8_gemm_v2(A, trans_A, B, trans_B, out_dtype, A_scale_inv=None, B_scale_inv=None, bias=None):
    """torch.ops.hpu.fp8_gemm_v2 without accumulate: the FP8 operands' product (exact), times the A
    (row) and B (column) inverse scales, plus `bias` (the card test's reference adds it to the
    product: test_hpu_fp8_ops.py::test_fp8_gemm_v2), in `out_dtype`."""
    a = A.double().t() if trans_A else A.double()
    b = B.double().t() if trans_B else B.double()
    out = (a @ b).float()
    if A_scale_inv is not None:
        out = out * torch.as_tensor(A_scale_inv).float()
    if B_scale_inv is not None:
        out = out * torch.as_tensor(B_scale_inv).float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fused_fp8_moe_eager(hidden_fp8, hidden_scale, routing, router_weights, w12, w12_scale, w3, w3_scale,
                        experts_min: int, experts_max: int, fp8_max: float, dynamic_quant):
    """mixture_of_experts.fp8_fused_weights_dynamic as the bridge's eager decomposition computes it
    (habana_eager/ops/mixture_of_experts.cpp, `mixture_of_experts_fp8_common_dynamic`): for every local expert in
    ascending id order, the gate and up GEMMs to bf16, SwiGLU in bf16 (silu(gate) * up), that
    product quantised per token (scale (amax + 1e-8) / FP8 max, as vllm-gaudi's dynamic_quant),
    the down GEMM to bf16, times the token's router weight for that expert (0 when it did not
    route there), added into a bf16 sum. The eager source passes the per-token scale itself to
    its cast and no A scale to the down GEMM; this stand-in keeps the documented meaning
    (quantise by the reciprocal, rescale the product by the scale), which a literal reading would
    not dequantise. hidden_fp8 [T, H]; w12 [E, 2I, H]; w3 [E, H, I]; weights' scales per row."""
    tokens = hidden_fp8.shape[0]
    local = experts_max - experts_min + 1
    padded = torch.zeros(tokens, local, dtype=router_weights.dtype)
    for t in range(tokens):
        for e, w in zip(routing[t].tolist(), router_weights[t].tolist()):
            if experts_min <= e <= experts_max:
                padded[t, e - experts_min] = w
    out = torch.zeros(hidden_fp8.shape, dtype=torch.bfloat16)
    for i in range(local):
        gate_up = fp8_gemm_v2(hidden_fp8, False, w12[i], True, torch.bfloat16, hidden_scale, w12_scale[i])
        gate, up = gate_up.chunk(2, -1)
        act = torch.nn.functional.silu(gate) * up  # bf16 throughout
        a_fp8, a_scale = dynamic_quant(act)
        down = fp8_gemm_v2(a_fp8, False, w3[i], True, torch.bfloat16, a_scale, w3_scale[i])
        out += down * padded[:, i:i + 1].to(torch.bfloat16)
    return out


# tests/pytest_working/lazy/test_hpu_rotary_pos_embedding_helper.py::test_apply_rotary_pos_emb_v1_fwd_bwd
# accepts a card RoPE within this absolute and relative tolerance of its fp32 reference, by dtype
# (float32 0.001, half types 0.012) ...
ROPE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.012, torch.float16: 0.012}
# ... and tests/pytest_working/lazy/test_hpu_rms_norm.py::test_rms_norm_fwd_bwd a card RMSNorm
# (float32 0.001, half types 0.015).
RMS_NORM_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.015, torch.float16: 0.015}


class RotaryPosEmbeddingMode(enum.Enum):
    """python_packages/habana_frameworks/torch/hpex/kernels/RotaryPosEmbeddingHelper.py."""
    BLOCKWISE = 0
    PAIRWISE = 1


def apply_rotary_pos_emb(p, cos, sin, position_ids=None, offset: int = 0,
                         mode: RotaryPosEmbeddingMode = RotaryPosEmbeddingMode.BLOCKWISE):
    """habana_frameworks.torch.hpex.kernels.apply_rotary_pos_emb with cos and sin given
    (RotaryPosEmbeddingHelper.py, `apply_rotary_pos_emb`), as vllm-gaudi calls it for a NeoX-style
    RoPE: BLOCKWISE, no position ids, offset 0 (anything else is refused, not modelled). The helper first matches dtypes
    (`match_data_types`: all three in fp32 when any of them is fp32, else cos and sin in p's dtype),
    then calls hpu::rotary_pos_embedding, whose output has p's sizes and dtype
    (hpu_ops/backend/rotary_pos_embedding.cpp, RotaryPosEmbedding::AddNode). Its arithmetic is the
    helper's documented formula and the card test's reference (test_hpu_rotary_pos_embedding_helper.py,
    `apply_rotary_pos_emb_v1_ref`): p * cos + rotate_half(p) * sin, rotate_half(x) being x's second
    half negated, then its first half. Taken here in the matched dtype; a card is only known to be
    within ROPE_TOLERANCE of it."""
    if position_ids is not None or offset != 0 or mode != RotaryPosEmbeddingMode.BLOCKWISE:
        raise NotImplementedError("stand-in: only BLOCKWISE with position_ids=None, offset=0")
    if torch.float32 in (p.dtype, cos.dtype, sin.dtype):
        p, cos, sin = p.float(), cos.float(), sin.float()
    else:
        cos, sin = cos.to(p.dtype), sin.to(p.dtype)
    first, second = p.chunk(2, dim=-1)
    return p * cos + torch.cat((-second, first), dim=-1) * sin


class FusedRMSNorm:
    """habana_frameworks.torch.hpex.normalization.FusedRMSNorm, forward only
    (python_packages/habana_frameworks/torch/hpex/normalization/FusedRMSNorm.py): `apply(data_in,
    gamma, eps)` returns the first output of hpu::rms_norm, which has data_in's sizes and dtype
    (hpu_ops/backend/rms_norm.cpp, RMSNorm::AddNode). Its arithmetic is the card test's reference
    (tests/pytest_working/lazy/test_hpu_rms_norm.py, `rms_norm_fwd_ref`): data_in * gamma /
    sqrt(mean(data_in ** 2 over the last dim) + eps), taken here in fp32 as that reference is, then
    cast to data_in's dtype; a card is only known to be within RMS_NORM_TOLERANCE of it."""

    @staticmethod
    def apply(data_in, gamma, eps, use_stages=True, bwd_mode=0):
        x = data_in.float()
        rms = torch.sqrt(x.square().mean(dim=-1, keepdim=True) + eps)
        return (x * gamma.float() / rms).to(data_in.dtype)


def _moe_activation(name: str):
    """habana_eager/ops/mixture_of_experts.cpp, `get_activation_fn`: gelu, relu or silu."""
    functions = {"gelu": torch.nn.functional.gelu, "relu": torch.nn.functional.relu, "silu": torch.nn.functional.silu}
    if name not in functions:
        raise ValueError(f"mixture_of_experts: unsupported activation {name!r}")
    return functions[name]


def mixture_of_experts_fused_weights(hidden_states, expert_routing_table, router_weights, w12, w3,
                                     permuted_weights: bool, activation: str, experts_min: int, experts_max: int,
                                     chunk_size: int = 0, total_experts: int = 0):
    """torch.ops.hpu.mixture_of_experts.fused_weights (the overload a call naming `w12` and no
    scales resolves to) as the bridge's eager decomposition computes it (habana_eager/ops/
    mixture_of_experts.cpp: `mixture_of_experts_fused_weights`, which splits each w12 with
    `split_weights_tensor` and runs `mixture_of_experts_common`): each w12 split in halves (dim 0
    when `permuted_weights`, the weights then [out, in] and transposed for the product), the gate
    half w1 and the up half w2; for every local expert in list order, act(x @ w1) * (x @ w2) @ w3,
    times the token's router weight for that expert (zero when it did not route there), added into
    a sum of hidden_states' dtype and shape. Every product and the sum stay in the inputs' dtype
    (bf16 when serving). The decomposition scatters the router weights at the routing table's ids
    as given (column = global id, right for experts_min = 0); this stand-in takes column
    id - experts_min and drops ids outside [experts_min, experts_max], the documented meaning under
    expert parallelism. chunk_size and total_experts tune the kernel's tiling, not its result."""
    act = _moe_activation(activation)
    tokens = hidden_states.shape[0]
    local = len(w12)
    if experts_max - experts_min + 1 != local or len(w3) != local:
        raise ValueError(f"mixture_of_experts: {len(w12)} w12 and {len(w3)} w3 for experts "
                         f"{experts_min}..{experts_max}")
    padded = torch.zeros(tokens, local, dtype=router_weights.dtype)
    in_range = (expert_routing_table >= experts_min) & (expert_routing_table <= experts_max)
    padded.scatter_(1, torch.where(in_range, expert_routing_table - experts_min, 0),
                    torch.where(in_range, router_weights, torch.zeros_like(router_weights)))
    out = torch.zeros_like(hidden_states)
    for e in range(local):
        w1, w2 = w12[e].chunk(2, dim=0 if permuted_weights else 1)
        down = w3[e]
        if permuted_weights:
            w1, w2, down = w1.t(), w2.t(), down.t()
        out += ((act(hidden_states @ w1) * (hidden_states @ w2)) @ down) * padded[:, e:e + 1]
    return out
