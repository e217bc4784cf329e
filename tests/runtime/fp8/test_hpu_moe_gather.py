"""beam_hpu.runtime.fp8.hpu_moe_gather: the gathered per-channel FP8 MoE equals the dense pass over every local
expert, bit for bit (same per-expert GEMM on the same rows, same ascending fp32 combine), at
T = 1, 2, 4, 8, 16, in both roundings of BEAM_EXACT_ROUNDING and both FP8 ranges, with shared
experts, all tokens on one expert, and none on this rank (expert parallel by offset and by map).

Where the GEMM rows differ (the CPU portable path computes each expert on its routed rows only), a
GEMM may sum in another order; the bound for that case is one FP8 step of every down-projection
input element (see `order_change_bound`), and the portable path is held to it.
"""

import pytest
import torch

from beam_hpu.runtime.fp8.portable_moe import fp8_experts_forward
from beam_hpu.runtime.fp8 import hpu_moe_gather as moe_gather
from beam_hpu.runtime.fp8.hpu_moe_gather import (
    combine_weights,
    dense_fp8_moe,
    gathered_count,
    gathered_fp8_moe,
    local_ids_from_map,
    local_ids_from_offset,
    routed_local_experts,
)
from beam_hpu.quant.rounding import FP8_E4M3FN_MAX, GAUDI2_FP8_MAX, per_token_fp8
from beam_hpu.settings.switches import SwitchError

H, I, E, K = 64, 32, 16, 4  # hidden, expert width, local experts, top-k
TOKENS = (1, 2, 4, 8, 16)
ROUNDINGS = [(GAUDI2_FP8_MAX, True), (GAUDI2_FP8_MAX, False), (FP8_E4M3FN_MAX, False)]


def quantiser(fp8_max, exact):
    return lambda t: per_token_fp8(t, fp8_max, exact)


def experts(seed=0, local=E):
    g = torch.Generator().manual_seed(seed)

    def fp8(*shape):
        return (torch.randn(*shape, generator=g) * 60).clamp(-240, 240).to(torch.float8_e4m3fn)

    return (fp8(local, 2 * I, H), torch.rand(local, 2 * I, 1, generator=g) / 50 + 1e-3,
            fp8(local, H, I), torch.rand(local, H, 1, generator=g) / 50 + 1e-3)


def routing(tokens, seed, local=E, k=K, spread=None):
    """Distinct top-k ids per token from `spread` experts (all local ones by default)."""
    g = torch.Generator().manual_seed(seed)
    spread = spread or local
    ids = torch.stack([torch.randperm(spread, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g) + 0.1
    return ids, weights / weights.sum(-1, keepdim=True) * 2.5  # Beam: renormalised, x 2.5


def activations(tokens, seed, dtype=torch.bfloat16):
    return (torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def both(x, weights, local_ids, quant, w=None):
    w = w or experts()
    return (gathered_fp8_moe(x, *w, weights, local_ids, quant), dense_fp8_moe(x, *w, weights, local_ids, quant))


def bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("fp8_max,exact", ROUNDINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gathered_equals_dense_bit_for_bit(tokens, fp8_max, exact, dtype):
    ids, weights = routing(tokens, seed=tokens)
    x = activations(tokens, seed=tokens, dtype=dtype)
    got, want = both(x, weights, ids, quantiser(fp8_max, exact))
    assert got.dtype == dtype and torch.equal(bits(got), bits(want))
    assert want.abs().amax() > 0


@pytest.mark.parametrize("tokens", TOKENS)
def test_tokens_sharing_experts_and_all_on_one_expert(tokens):
    quant = quantiser(GAUDI2_FP8_MAX, False)
    x = activations(tokens, seed=7)
    # Every token picks from the same 5 experts: heavy sharing, G slots mostly padding.
    ids, weights = routing(tokens, seed=3, spread=5)
    got, want = both(x, weights, ids, quant)
    assert torch.equal(bits(got), bits(want))
    # top-1 on one expert for every token (k = 1), and k = 4 with expert 9 in every token's set.
    one = torch.full((tokens, 1), 9)
    got, want = both(x, torch.ones(tokens, 1), one, quant)
    assert torch.equal(bits(got), bits(want)) and want.abs().amax() > 0
    ids[:, 0] = 9
    ids[:, 1:] = torch.tensor([1, 2, 3])
    got, want = both(x, weights, ids, quant)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("tokens", TOKENS)
def test_expert_parallel_rank_sees_only_its_experts(tokens):
    # 4 ranks of 16 local experts (64 global), this one rank 2: ids 32..47 are local.
    quant = quantiser(GAUDI2_FP8_MAX, False)
    ids, weights = routing(tokens, seed=11 + tokens, local=64, spread=64)
    local = local_ids_from_offset(ids, experts_min=32, local_experts=E)
    assert torch.equal(local >= 0, (ids >= 32) & (ids < 48))
    x = activations(tokens, seed=5)
    got, want = both(x, weights, local, quant)
    assert torch.equal(bits(got), bits(want))
    # ... and it is the same through vLLM's expert_map (global -> local, -1 elsewhere).
    expert_map = torch.full((64,), -1)
    expert_map[32:48] = torch.arange(E)
    assert torch.equal(local_ids_from_map(ids, expert_map), local)


@pytest.mark.parametrize("tokens", TOKENS)
def test_no_expert_on_this_rank_gives_exact_zeros(tokens):
    ids, weights = routing(tokens, seed=2, local=64, spread=32)  # all in 0..31; this rank holds 32..47
    local = local_ids_from_offset(ids, experts_min=32, local_experts=E)
    assert (local == -1).all()
    got, want = both(activations(tokens, seed=1), weights, local, quantiser(GAUDI2_FP8_MAX, False))
    assert torch.equal(got, torch.zeros_like(got)) and torch.equal(want, got)
    assert not torch.signbit(got).any()  # +0, not -0: padding experts add y * 0


def test_gathered_count_is_static_and_covers_every_routed_expert():
    assert [gathered_count(t, 8, 32) for t in TOKENS] == [8, 16, 32, 32, 32]
    assert gathered_count(1, 8, 256) == 8 and gathered_count(0, 8, 32) == 0
    for tokens in TOKENS:
        for seed in range(20):
            ids, _ = routing(tokens, seed=seed, spread=E)
            chosen = routed_local_experts(ids, E, gathered_count(tokens, K, E))
            assert chosen.shape == (gathered_count(tokens, K, E),)
            assert torch.equal(chosen, chosen.sort().values) and len(set(chosen.tolist())) == len(chosen)
            assert set(ids.unique().tolist()) <= set(chosen.tolist())


def test_combine_weights_drop_other_ranks_and_keep_each_tokens_weight():
    local = torch.tensor([[0, -1, 3], [3, 2, -1]])
    weights = torch.tensor([[0.5, 0.25, 0.125], [1.0, 2.0, 4.0]])
    combine = combine_weights(local, weights, 4)
    assert torch.equal(combine, torch.tensor([[0.5, 0, 0, 0.125], [0, 0, 2.0, 1.0]]))


def test_a_dropped_or_misplaced_expert_is_seen(monkeypatch):
    # The equality above can fail: one slot short of T x k, or the slots summed out of id order.
    quant, w = quantiser(GAUDI2_FP8_MAX, False), experts()
    ids, weights = routing(1, seed=4)  # one token: its 4 experts fill G = 4 exactly
    x = activations(1, seed=4)
    want = dense_fp8_moe(x, *w, weights, ids, quant)
    full = moe_gather.gathered_count
    monkeypatch.setattr(moe_gather, "gathered_count", lambda t, k, e: full(t, k, e) - 1)
    assert not torch.equal(gathered_fp8_moe(x, *w, weights, ids, quant), want)
    monkeypatch.undo()
    # Descending ids: the same terms in another fp32 order (visible in fp32 outputs).
    ids, weights = routing(16, seed=4)
    x = activations(16, seed=4, dtype=torch.float32)
    chosen = routed_local_experts(ids, E, gathered_count(16, K, E)).flip(0)
    combine = combine_weights(ids, weights, E).index_select(1, chosen)
    reordered = moe_gather._experts(x, *quant(x), *(t.index_select(0, chosen) for t in w), combine, quant,
                                    moe_gather.cpu_fp8_gemm)
    want = dense_fp8_moe(x, *w, weights, ids, quant)
    assert not torch.equal(reordered, want)
    assert (reordered - want).abs().amax() < 1e-5 * want.abs().amax()  # an order change, no more


def e4m3_spacing(q: torch.Tensor) -> torch.Tensor:
    """The distance from each e4m3 value to its neighbours (the larger side): 2^(e - 3) in
    binade [2^e, 2^(e+1)), 2^-9 among subnormals."""
    mag = q.float().double().abs()
    exponent = torch.floor(torch.log2(mag.clamp_min(2.0**-6)))
    return torch.exp2(exponent - 3)


def order_change_bound(x, w, weights, local_ids, quant, fp8_max):
    """Per output element: how far another summation order inside the GEMMs can move the result.

    The input quantisation is per row, the same in both. The up GEMM's fp32 sum moves by at most
    H 2^-23 sum|terms| (any order); through SwiGLU (|silu'| < 1.1) that bounds how far each
    activation can move, and its row's amax with it (so the row's scale). An activation element
    re-rounds to a neighbouring FP8 value only if its scaled value lies that close to a rounding
    midpoint; then it moves by one e4m3 spacing. The down GEMM's own order adds at most
    I 2^-23 sum|terms|. Everything is summed with the combine weights; nothing is assumed about
    the kernel but fp32 accumulation."""
    w13, s13, w2, s2 = w
    combine = combine_weights(local_ids, weights, w13.shape[0]).double()
    x_fp8, x_scale = quant(x)
    x_abs = x_fp8.float().double().abs() * x_scale.double()  # [T, H]
    bound = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(w13.shape[0]):
        gate_up = moe_gather.cpu_fp8_gemm(x_fp8, x_scale, w13[e], s13[e])  # [T, 2I] fp32
        d_gate_up = H * 2.0**-23 * (x_abs @ (w13[e].float().double().abs() * s13[e].double()).t())
        gate, up = gate_up.double().chunk(2, -1)
        d_gate, d_up = d_gate_up.chunk(2, -1)
        silu = gate * torch.sigmoid(gate)
        d_act = 1.1 * d_gate * (up.abs() + d_up) + (silu.abs() + 1.1 * d_gate) * d_up  # [T, I]
        act = swiglu(gate_up.to(x.dtype))
        a_fp8, a_scale = quant(act)
        scaled = act.double() / a_scale.double()  # where the rounding happened
        d_scaled = (d_act + d_act.amax(-1, keepdim=True) * scaled.abs() / fp8_max) / a_scale.double()
        spacing = e4m3_spacing(a_fp8)
        to_midpoint = ((scaled - a_fp8.float().double()).abs() - spacing / 2).abs()
        may_flip = (to_midpoint <= d_scaled * 1.01).double()
        w2_abs = w2[e].float().double().abs() * s2[e].double()  # [H, I]
        flips = (may_flip * spacing * a_scale.double()) @ w2_abs.t()  # [T, H]
        terms = (a_fp8.float().double().abs() * a_scale.double()) @ w2_abs.t()  # [T, H]
        bound += combine[:, e:e + 1] * (flips + I * 2.0**-23 * terms)
    return bound * 1.01 + 1e-6


def swiglu(t):
    from beam_hpu.model.ops import swiglu_fp32

    return swiglu_fp32(t)


@pytest.mark.parametrize("tokens", TOKENS)
def test_portable_per_expert_rows_within_the_order_change_bound(tokens):
    # The CPU portable dense path runs each expert's GEMM on its routed rows only: other row
    # counts may pick another GEMM blocking. Bit-equal where the kernel does not, else bounded.
    quant = quantiser(FP8_E4M3FN_MAX, False)
    ids, weights = routing(tokens, seed=20 + tokens)
    x, w = activations(tokens, seed=tokens, dtype=torch.float32), experts(1)
    got = gathered_fp8_moe(x, *w, weights, ids, quant)
    portable = fp8_experts_forward(x, *w, weights, ids, None, quant)
    bound = order_change_bound(x, w, weights, ids, quant, FP8_E4M3FN_MAX)
    assert ((got.double() - portable.double()).abs() <= bound).all()
    # A bound that can fail: a dropped expert moves outputs by hundreds (its whole contribution).
    # Measured here: bound / amax 1e-4 (T = 1) to 5e-3 (T = 8), and got == portable bit for bit.
    assert bound.amax() < 1e-2 * got.double().abs().amax()


@pytest.mark.parametrize("text,limit", [("0", 0), ("1", 1), ("16", 16)])
def test_switch_values(text, limit):
    assert moe_gather.gather_limit({"BEAM_MOE_GATHER": text}) == limit


@pytest.mark.parametrize("text", ["-1", "one", "1.5", ""])
def test_switch_refuses_what_it_cannot_use(text):
    with pytest.raises(SwitchError, match="BEAM_MOE_GATHER"):
        moe_gather.gather_limit({"BEAM_MOE_GATHER": text})


def test_which_steps_take_the_gathered_path():
    assert [moe_gather.takes_gathered_path(t, 2) for t in (1, 2, 3, 16)] == [True, True, False, False]
    assert not any(moe_gather.takes_gathered_path(t, 0) for t in TOKENS)


@pytest.mark.parametrize("model_type,static,block,env,limit", [
    ("beam", False, False, {"BEAM_MOE_GATHER": "4"}, 4),
    ("beam", False, False, {}, 0),  # the default: off, vllm-gaudi's fused op (the recipe's value)
    ("beam", False, False, {"BEAM_MOE_GATHER": "1"}, 1),  # the opt-in variant
    ("beam", False, False, {"BEAM_MOE_GATHER": "0"}, 0),
    ("llama", False, False, {"BEAM_MOE_GATHER": "4"}, 0),
    ("beam", True, False, {"BEAM_MOE_GATHER": "4"}, 0),  # static input scales: not Beam's scheme
    ("beam", False, True, {"BEAM_MOE_GATHER": "4"}, 0),  # block FP8: not Beam's scheme
])
def test_hpu_layers_gather_only_for_beams_scheme(model_type, static, block, env, limit):
    assert moe_gather.hpu_gather_limit(model_type, static, block, env) == limit


def test_hpu_layer_without_a_model_type_keeps_the_stock_op():
    # Turned on, it must not refuse (or change) a load it cannot attribute to Beam.
    assert moe_gather.hpu_gather_limit(None, False, False, {"BEAM_MOE_GATHER": "1"}) == 0
    with pytest.raises(SwitchError, match="BEAM_MOE_GATHER"):  # still validated
        moe_gather.hpu_gather_limit(None, False, False, {"BEAM_MOE_GATHER": "x"})
