"""Accuracy metrics for comparing a model against a reference, position by position.

Inputs are natural-log probabilities: full next-token distributions `[positions, vocab]` (several
prompts: concatenate along positions), or the log-probabilities of the actual next tokens
`[positions]`.
"""

from __future__ import annotations

import math

import torch


def _same_shape(ref: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if ref.shape != test.shape or ref.ndim != 2:
        raise ValueError(f"expected two [positions, vocab] log-probability tensors, got {tuple(ref.shape)} "
                         f"and {tuple(test.shape)}")
    return ref.double(), test.double()


def kl_divergence(ref_logprobs: torch.Tensor, test_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(ref || test) at every position, in nats: [positions]. Tokens the reference gives
    probability 0 contribute nothing; a token only the test rules out makes it infinite."""
    ref, test = _same_shape(ref_logprobs, test_logprobs)
    p = ref.exp()
    terms = torch.where(p > 0, p * (ref - test), torch.zeros_like(p))
    return terms.sum(dim=-1)


def mean_kl(ref_logprobs: torch.Tensor, test_logprobs: torch.Tensor) -> float:
    return kl_divergence(ref_logprobs, test_logprobs).mean().item()


def top1_agreement(ref_logprobs: torch.Tensor, test_logprobs: torch.Tensor) -> float:
    """Fraction of positions where both pick the same most likely next token."""
    ref, test = _same_shape(ref_logprobs, test_logprobs)
    return (ref.argmax(dim=-1) == test.argmax(dim=-1)).double().mean().item()


def perplexity(token_logprobs: torch.Tensor) -> float:
    """exp(-mean log p(actual next token)) over all positions."""
    if token_logprobs.ndim != 1 or token_logprobs.numel() == 0:
        raise ValueError(f"expected a non-empty [positions] tensor, got {tuple(token_logprobs.shape)}")
    return math.exp(-token_logprobs.double().mean().item())


def perplexity_change(test_token_logprobs: torch.Tensor, ref_token_logprobs: torch.Tensor) -> float:
    """Relative perplexity change of test over ref: +0.02 means 2% higher perplexity."""
    if test_token_logprobs.shape != ref_token_logprobs.shape:
        raise ValueError(f"positions differ: {tuple(test_token_logprobs.shape)} vs {tuple(ref_token_logprobs.shape)}")
    return perplexity(test_token_logprobs) / perplexity(ref_token_logprobs) - 1.0
