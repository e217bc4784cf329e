"""BEAM_EXACT_ROUNDING's two roundings (beam_hpu.quant.rounding): where they must differ, and
that they agree everywhere else; the served CPU experts and the reference take them from there."""

import math

import pytest
import torch

from beam_hpu.quant.rounding import (FP8_E4M3FN_MAX, GAUDI2_FP8_MAX, fake_quant_per_token, fp32_product_cast_to_fp8,
                                     gaudi_cast_to_fp8, per_token_fp8)
from tests.support.gaudi import habana_ops

FP8 = torch.float8_e4m3fn


def e4m3_midpoints(lo: float, hi: float) -> torch.Tensor:
    """Every point halfway between two neighbouring positive e4m3 values in [lo, hi]."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid) & (grid > 0)].unique().sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    return mids[(mids >= lo) & (mids <= hi)]


def one_row_with_scale(values: torch.Tensor, amax: float) -> torch.Tensor:
    """A single row: the values, and one element `amax` that fixes the row's scale."""
    return torch.cat([values, torch.tensor([amax])])[None]


def division_and_reciprocal_disagree(fp8_max: float, amax: float) -> torch.Tensor:
    """fp32 values x below `amax` whose x / s and x * (1 / s) (s = amax / fp8_max) round to
    different e4m3 values: x within one ulp of s * (a midpoint of the e4m3 grid)."""
    s = torch.tensor(amax) / fp8_max
    base = (e4m3_midpoints(1.0, fp8_max - 1) * s).float()
    x = torch.cat([base] + [torch.nextafter(base, torch.full_like(base, d)) for d in (math.inf, -math.inf)])
    by_division = (x / s).to(FP8).float()
    by_reciprocal = (x * (1.0 / s)).to(FP8).float()
    return x[by_division != by_reciprocal]


@pytest.mark.parametrize("fp8_max", [FP8_E4M3FN_MAX, GAUDI2_FP8_MAX])
def test_division_and_reciprocal_round_apart_where_they_must(fp8_max):
    amax = 3.0  # 3 + 1e-8 == 3 in fp32: the two modes' scales are the same number
    assert torch.tensor(amax) + 1e-8 == torch.tensor(amax)
    x = division_and_reciprocal_disagree(fp8_max, amax)
    assert x.numel() >= 5, "no input where x / s and x * (1 / s) round apart: the test needs one"
    row = one_row_with_scale(x, amax)
    q_exact, s_exact = per_token_fp8(row, fp8_max, exact=True)
    q_fast, s_fast = per_token_fp8(row, fp8_max, exact=False)
    assert torch.equal(s_exact, s_fast)
    exact, fast = q_exact.float()[0, :-1], q_fast.float()[0, :-1]
    s = s_exact.item()
    # Each mode is its own definition: exact = x / s, fast = x * (1 / s), both rounded to nearest even.
    assert torch.equal(exact, (x / s).to(FP8).float())
    assert torch.equal(fast, (x * (1.0 / torch.tensor(s))).to(FP8).float())
    assert bool((exact != fast).all())
    # One e4m3 step apart, on either side of the midpoint that sits between them.
    step = (exact - fast).abs()
    assert bool((step <= torch.maximum(exact, fast).abs() / 8 + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modes_agree_everywhere_else(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g) * torch.logspace(-1, 2, 64)[:, None]
    # One row of amax 3 carries inputs where division and reciprocal round apart among random ones.
    disagree = division_and_reciprocal_disagree(FP8_E4M3FN_MAX, 3.0)
    x[0] = torch.rand(512, generator=g) * 5.8 - 2.9
    x[0, :disagree.numel()], x[0, -1] = disagree, 3.0
    x = x.to(dtype)
    q_exact, s_exact = per_token_fp8(x, FP8_E4M3FN_MAX, exact=True)
    q_fast, s_fast = per_token_fp8(x, FP8_E4M3FN_MAX, exact=False)
    if dtype == torch.float32:
        # amax >= 0.1: 1e-8 is below half an fp32 ulp of amax, so the scales are equal.
        assert torch.equal(s_exact, s_fast)
        s = s_exact
        by_division = x / s
        by_reciprocal = x * (1.0 / s)
        apart = by_division.to(FP8) != by_reciprocal.to(FP8)
        differ = q_exact.float() != q_fast.float()
        # They differ exactly where the two products round apart, and there are such places.
        assert torch.equal(differ, apart) and differ.sum().item() >= disagree.numel()
        assert differ.float().mean().item() < 1e-3  # which is rare
    else:
        # bf16: the fast path's scale is a bf16 number (dynamic_quant computes it in the input's
        # dtype), within bf16's relative precision of the exact fp32 scale.
        assert torch.equal(s_fast, s_fast.to(torch.bfloat16).float())
        assert not torch.equal(s_fast, s_exact)
        assert torch.allclose(s_fast, s_exact, rtol=2 ** -8, atol=0)
    # Both land on the grid inside the range, and reproduce x to FP8 precision.
    for q, s in ((q_exact, s_exact), (q_fast, s_fast)):
        assert q.float().abs().max().item() <= FP8_E4M3FN_MAX
        torch.testing.assert_close(q.float() * s, x.float(), rtol=2 ** -3, atol=s.max().item())


def test_epsilon_changes_an_all_tiny_row():
    amax = 1e-9
    x = torch.tensor([[amax, -amax / 2, amax / 4, 0.0]])
    q_exact, s_exact = per_token_fp8(x, FP8_E4M3FN_MAX, exact=True)
    q_fast, s_fast = per_token_fp8(x, FP8_E4M3FN_MAX, exact=False)
    assert s_exact.item() == pytest.approx(amax / 448, rel=1e-6)
    assert s_fast.item() == pytest.approx((amax + 1e-8) / 448, rel=1e-6)
    # exact maps the absmax onto 448; the fast path onto 448 / 11 = 40.7, which rounds to 40.
    assert q_exact[0, 0].float().item() == 448.0
    assert q_fast[0, 0].float().item() == 40.0
    assert fake_quant_per_token(x, exact=True)[0, 0].item() == pytest.approx(amax, rel=1e-6)
    assert fake_quant_per_token(x, exact=False)[0, 0].item() == pytest.approx(40 * (amax + 1e-8) / 448, rel=1e-6)


def test_all_zero_row_is_zeros_in_both_modes():
    x = torch.zeros(2, 8)
    for exact in (True, False):
        q, s = per_token_fp8(x, GAUDI2_FP8_MAX, exact)
        assert torch.equal(q.float(), x) and bool((s > 0).all())


def test_fast_path_saturates_where_its_bf16_reciprocal_overshoots():
    # bf16 scale and bf16 reciprocal: amax * (1 / scale) may land above fp8_max; the cast saturates.
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(4096, 16, generator=g) + 0.5).to(torch.bfloat16)
    s = (x.abs().amax(-1, keepdim=True) + 1e-8) / GAUDI2_FP8_MAX
    overshoot = (x.float() * (1.0 / s).float()).abs().amax(-1) > GAUDI2_FP8_MAX
    assert bool(overshoot.any()), "no overshooting row: the test needs one"
    q, _ = per_token_fp8(x, GAUDI2_FP8_MAX, exact=False)
    assert q.float().abs().amax().item() == GAUDI2_FP8_MAX
    assert bool((q.float().abs().amax(-1)[overshoot] == GAUDI2_FP8_MAX).all())


def test_fake_quant_is_the_dequantised_pair():
    x = torch.randn(5, 33)
    for exact in (True, False):
        q, s = per_token_fp8(x, GAUDI2_FP8_MAX, exact)
        assert torch.equal(fake_quant_per_token(x, GAUDI2_FP8_MAX, exact), q.float() * s)


def test_reference_rounds_in_the_mode_it_is_given():
    from beam_hpu.reference import in_memory as reference

    assert reference.fake_quant_per_token is fake_quant_per_token  # one function, not a copy
    x = torch.tensor([[1e-9, 5e-10]])
    assert not torch.equal(reference.fake_quant_per_token(x), reference.fake_quant_per_token(x, exact=False))


def test_gaudi_mode_is_habanas_documented_cast_and_not_the_fp32_product():
    """The Gaudi mode casts as Habana's card test of cast_to_fp8_v2 defines it (the product in the
    input's dtype; tests/support/gaudi/habana_ops.py writes that definition on its own). On bf16
    activations of Beam's width it differs from the fp32-product model on a few per cent of
    elements, by one step; on fp32 inputs the two are one."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 5120, generator=g) * 2).to(torch.bfloat16)
    q, s = per_token_fp8(x, GAUDI2_FP8_MAX, exact=False)
    documented = habana_ops.cast_to_fp8_v2(x, (1.0 / s.to(torch.bfloat16)), GAUDI2_FP8_MAX)
    assert torch.equal(q.view(torch.uint8), documented.view(torch.uint8))
    inv = 1.0 / s.to(torch.bfloat16)
    gaudi, fp32 = gaudi_cast_to_fp8(x, inv, GAUDI2_FP8_MAX), fp32_product_cast_to_fp8(x, inv, GAUDI2_FP8_MAX)
    apart = (gaudi.view(torch.uint8).int() - fp32.view(torch.uint8).int()).abs()
    assert 0.01 < (apart > 0).float().mean().item() < 0.10 and apart.max().item() == 1
    xf = x.float()
    assert torch.equal(gaudi_cast_to_fp8(xf, inv.float(), GAUDI2_FP8_MAX).view(torch.uint8),
                       fp32_product_cast_to_fp8(xf, inv.float(), GAUDI2_FP8_MAX).view(torch.uint8))
    # The card computes float64 as fp32: a float64 input casts as its fp32 copy does.
    assert torch.equal(gaudi_cast_to_fp8(xf.double(), inv.double(), GAUDI2_FP8_MAX).view(torch.uint8),
                       gaudi_cast_to_fp8(xf, inv.float(), GAUDI2_FP8_MAX).view(torch.uint8))
