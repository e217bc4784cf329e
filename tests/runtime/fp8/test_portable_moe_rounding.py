"""The portable FP8 experts round activations as switch BEAM_EXACT_ROUNDING says."""

import pytest
import torch
import torch.nn.functional as F

from beam_hpu.runtime.fp8.portable_moe import activation_quantiser, fp8_experts_forward
from beam_hpu.quant.rounding import fake_quant_per_token
from beam_hpu.settings.switches import SwitchError
from tests.support.moe_weights import E, H, I, K, fp8_weights

T = 6


@pytest.fixture
def moe_with_tiny_token():
    """Experts and tokens; token 0 is all tiny, where the fast path's 1e-8 changes its rounding."""
    g = torch.Generator().manual_seed(3)
    w13, s13 = fp8_weights(g, 2 * I, H)
    w2, s2 = fp8_weights(g, H, I)
    x = torch.randn(T, H, generator=g)
    x[0] *= 1e-9
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    return x, w13, s13, w2, s2, torch.rand(T, K, generator=g), topk_ids


def expected(moe, exact: bool) -> torch.Tensor:
    """Per token and expert: dequantised weights, inputs fake-quantised in the given mode, fp32."""
    x, w13, s13, w2, s2, topk_weights, topk_ids = moe
    out = torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            e = topk_ids[t, k].item()
            gate, up = F.linear(fake_quant_per_token(x[t:t + 1], exact=exact), w13[e].float() * s13[e]).chunk(2, -1)
            act = F.silu(gate) * up
            y = F.linear(fake_quant_per_token(act, exact=exact), w2[e].float() * s2[e])[0]
            out[t] += topk_weights[t, k] * y
    return out


def test_the_switch_picks_the_rounding(moe_with_tiny_token):
    outs = {}
    for value, exact in (("1", True), ("0", False)):
        quant = activation_quantiser({"BEAM_EXACT_ROUNDING": value})
        outs[exact] = fp8_experts_forward(*moe_with_tiny_token, expert_map=None, quant_per_token=quant)
        torch.testing.assert_close(outs[exact], expected(moe_with_tiny_token, exact), rtol=1e-4, atol=1e-14)
    # The tiny token comes out differently in the two modes; it is not lost in the tolerance.
    tiny = (outs[True][0] - outs[False][0]).abs().max() / outs[True][0].abs().max()
    assert tiny.item() > 1e-3


def test_default_is_the_recipe_fast_path(moe_with_tiny_token):
    x = moe_with_tiny_token[0]
    q_default, s_default = activation_quantiser({})(x)
    q_fast, s_fast = activation_quantiser({"BEAM_EXACT_ROUNDING": "0"})(x)
    q_exact, s_exact = activation_quantiser({"BEAM_EXACT_ROUNDING": "1"})(x)
    assert torch.equal(q_default.float(), q_fast.float()) and torch.equal(s_default, s_fast)
    assert not torch.equal(s_default, s_exact)


def test_process_environment_is_read(monkeypatch, moe_with_tiny_token):
    x = moe_with_tiny_token[0]
    monkeypatch.setenv("BEAM_EXACT_ROUNDING", "1")
    _, s_exact = activation_quantiser()(x)
    monkeypatch.setenv("BEAM_EXACT_ROUNDING", "0")
    _, s_fast = activation_quantiser()(x)
    assert s_exact[0].item() == pytest.approx(x[0].abs().max().item() / 448, rel=1e-6)
    assert s_fast[0].item() == pytest.approx((x[0].abs().max().item() + 1e-8) / 448, rel=1e-6)


def test_bad_value_is_refused_by_name():
    with pytest.raises(SwitchError, match="BEAM_EXACT_ROUNDING"):
        activation_quantiser({"BEAM_EXACT_ROUNDING": "exact"})
