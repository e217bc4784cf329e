"""Beam's element-wise arithmetic that more than one path computes (the model's MLPs and the CPU
FP8 experts), so both round alike. Plain torch."""

import torch
import torch.nn.functional as F


def swiglu_fp32(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]. Beam evaluates the SwiGLU activation and product in fp32."""
    gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
    return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)
