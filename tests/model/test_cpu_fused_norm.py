"""Beam's CPU norm (vLLM-CPU's fused C++ rms_norm kernels) against vLLM's own RMSNorm.

Like with like: both are compared with the exact computation in fp32 on the same inputs, each
within the roundings it is allowed. The two bf16 paths round at different places (native rounds
the normalised row, then multiplies by the weight and rounds again; the kernel applies the weight
before its last rounding) and the kernel's vector code differs between CPUs (with and without
AVX512), so kernel against native in bf16 is not a fixed number of ulps on every host.
"""

import pytest
import torch

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.layernorm import RMSNorm

from beam_hpu.model.cpu_fused_norm import CpuKernelRMSNorm, beam_rms_norm


def _pair(hidden: int, dtype: torch.dtype, eps: float = 1e-6):
    with set_current_vllm_config(VllmConfig()):
        ours, theirs = CpuKernelRMSNorm(hidden, eps=eps), RMSNorm(hidden, eps=eps)
    w = torch.randn(hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    ours.weight.data = w.clone()
    theirs.weight.data = w.clone()
    return ours, theirs


def _exact(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the (model-dtype) inputs computed in fp32, not rounded."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def _bound(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # bf16: two roundings (8 significant bits each); fp32: a few ulps of reduction-order difference.
    return exact.abs() * (2.0**-7 * 2 if dtype == torch.bfloat16 else 2.0**-21) + 1e-6


def _close_to_exact(out: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> bool:
    return bool(((out.float() - exact).abs() <= _bound(exact, dtype)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_and_strided_inputs_match_vllm_rmsnorm(dtype):
    ours, theirs = _pair(32, dtype)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 8 * 32, generator=g).to(dtype)
    q = qkv[:, : 4 * 32].reshape(5, 4, 32)  # a strided view, as q heads split from qkv
    assert not q.is_contiguous()
    for x in (q, q.contiguous(), qkv[:, :32].contiguous()):
        exact = _exact(x, ours.weight.data, ours.variance_epsilon)
        assert _close_to_exact(theirs.forward_native(x), exact, dtype)
        assert _close_to_exact(ours.forward_native(x), exact, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_matches_vllm_rmsnorm(dtype):
    ours, theirs = _pair(128, dtype, eps=3e-5)
    g = torch.Generator().manual_seed(2)
    x, r = torch.randn(3, 128, generator=g).to(dtype), torch.randn(3, 128, generator=g).to(dtype)
    ref_out, ref_res = theirs.forward_native(x.clone(), r.clone())
    out, res = ours.forward_native(x.clone(), r.clone())
    # The residual sum in the model dtype: one rounding of the exact sum (the AVX2 kernel and the
    # native add round some sums to different neighbours, so each is checked against the sum).
    exact_sum = x.float() + r.float()
    for residual in (ref_res, res):
        assert residual.dtype == dtype
        assert _close_to_exact(residual, exact_sum, dtype)
    # The norm of that sum; in bf16 the rounded residual it normalises adds one more rounding.
    exact = _exact(exact_sum, ours.weight.data, ours.variance_epsilon)
    slack = 1.5 if dtype == torch.bfloat16 else 1.0
    for normed in (ref_out, out):
        assert ((normed.float() - exact).abs() <= slack * _bound(exact, dtype)).all()


def test_the_bound_tells_a_wrong_norm_apart():
    """A norm with the wrong eps (a depth-scaled residual's eps applied twice) is outside the bound."""
    ours, _ = _pair(128, torch.bfloat16, eps=0.5)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16) * 0.3
    assert not _close_to_exact(ours.forward_native(x), _exact(x, ours.weight.data, 0.25), torch.bfloat16)


def test_the_kernel_is_wrong_on_strided_rows_which_is_why_inputs_are_made_contiguous():
    ours, theirs = _pair(32, torch.float32)
    q = torch.randn(5, 8 * 32)[:, : 4 * 32].reshape(5, 4, 32)
    raw = torch.empty(q.shape)
    torch.ops._C.rms_norm(raw, q, ours.weight.data, ours.variance_epsilon)
    assert not torch.allclose(raw, theirs.forward_native(q))


def test_cpu_gets_the_kernel_norm():
    with set_current_vllm_config(VllmConfig()):
        assert isinstance(beam_rms_norm(64, 1e-6), CpuKernelRMSNorm)
