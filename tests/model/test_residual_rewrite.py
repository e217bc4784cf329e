"""Beam's depth-scaled residual stream, as transformers writes it, equals the model's rewrite:
an un-scaled running sum normed with eps * k (beam_hpu.model.beam.depth_scaled_norm_eps)."""

import math

import pytest
import torch

vllm_beam = pytest.importorskip("beam_hpu.model.beam")


def rms_norm(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_unscaled_sum_with_scaled_eps_equals_depth_scaled_stream(eps):
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(5, 64, generator=g, dtype=torch.float64)
    updates = [torch.randn(5, 64, generator=g, dtype=torch.float64) for _ in range(12)]
    h, total = embed, embed  # Beam's stream h_k and the model's running sum g_k
    for k, u in enumerate(updates, start=2):
        h = u / math.sqrt(k) + h * math.sqrt((k - 1) / k)
        total = total + u
        norm_of_stream = rms_norm(h, eps)
        norm_of_sum = rms_norm(total, vllm_beam.depth_scaled_norm_eps(eps, k))
        assert torch.allclose(norm_of_stream, norm_of_sum, rtol=1e-12, atol=1e-12)
    # Without the eps scaling the two differ (so the test can tell): large eps shows it plainly.
    if eps >= 1e-2:
        assert not torch.allclose(rms_norm(h, eps), rms_norm(total, eps), rtol=1e-6, atol=1e-6)
