"""A small MoE's FP8 expert weights as a checkpoint stores them: per-output-channel scales
(absmax onto 448, e4m3's max), shared by the portable FP8 expert tests."""

import torch

E, H, I, T, K = 6, 64, 32, 9, 2  # experts, hidden, intermediate, tokens, top-k
FP8 = torch.float8_e4m3fn


def fp8_weights(g, rows, cols):
    w = torch.randn(E, rows, cols, generator=g) * cols**-0.5
    scale = w.abs().amax(dim=-1, keepdim=True) / 448.0
    return (w / scale).to(FP8), scale
