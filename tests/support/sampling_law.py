"""The law a served sampled request must follow, and goodness-of-fit tests of draws against it.

`sampled_distribution` restates vLLM's sampler from the raw logprobs a server reports (vLLM 0.30's
default logprobs mode, after a structured-output grammar's mask: a masked token reports -9999).
`pit_values` turns sampled sequences into randomised probability integral transforms: at each
position t, with the target's law q_t given the tokens drawn before t (tokens ordered by
decreasing probability), u_t = q_t(tokens before x_t) + U * q_t(x_t) with U uniform on [0, 1).
If every token was drawn from its q_t, the u_t of a sequence are independent and uniform on
[0, 1) (the Rosenblatt transform), so all positions of all samples pool into one uniformity test;
a verifier that keeps a draft too often (or too rarely) piles them below (or above) q_t's top.
"""

from __future__ import annotations

import random

import torch


def sampled_distribution(top_logprobs: dict[int, float], temperature: float, top_k: int, top_p: float) -> dict[int, float]:
    """The distribution vLLM's sampler draws from, from raw logprobs of at least the top_k largest
    tokens: scaled by the temperature, the top_k largest kept and renormalised, then top-p as
    `apply_top_k_top_p_pytorch` does it: in ascending order, a token goes while the running sum up
    to it is at most 1 - top_p (the largest always stays)."""
    assert len(top_logprobs) >= top_k
    kept = sorted(top_logprobs.items(), key=lambda item: (-item[1], item[0]))[:top_k]
    probs = torch.tensor([lp for _, lp in kept], dtype=torch.float64).div(temperature).softmax(0)
    ascending = probs.flip(0)
    dropped = ascending.cumsum(0) <= 1 - top_p
    dropped[-1] = False
    kept_probs = torch.where(dropped, 0.0, ascending).flip(0)
    kept_probs = kept_probs / kept_probs.sum()
    return {token: float(p) for (token, _), p in zip(kept, kept_probs) if p > 0}


def chi_square_survival(statistic: float, df: int) -> float:
    """P(chi-square with df degrees of freedom >= statistic): Q(df / 2, statistic / 2)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def chi_square_p_value(counts: dict, expected: dict[object, float]) -> float:
    """Pearson's goodness-of-fit p-value of `counts` against probabilities `expected` (a draw
    outside it, probability 0, gives 0)."""
    if any(n and key not in expected for key, n in counts.items()):
        return 0.0
    total = sum(counts.values())
    statistic = sum((counts.get(key, 0) - total * p) ** 2 / (total * p) for key, p in expected.items())
    return chi_square_survival(statistic, len(expected) - 1)


def pit_values(sequences: list[tuple[list[int], list[dict[int, float]]]], sampling: dict, seed: int = 0,
               top_as: str | None = None) -> tuple[list[float], list[int]]:
    """Randomised PITs of the positions where the law is not a point mass, and those positions.

    sequences: per sample, (drawn tokens, the reported top logprobs at each). A token outside its
    law raises (no PIT is defined: the sample is impossible). `top_as` replaces each drawn token
    by what a broken verifier would have emitted ("top": always the law's top token; "not top":
    never it), to show the test tells those apart."""
    rng = random.Random(seed)
    values, positions = [], []
    for tokens, tops in sequences:
        for t, (token, top) in enumerate(zip(tokens, tops)):
            law = sampled_distribution(top, **sampling)
            if len(law) < 2:
                continue
            order = sorted(law, key=lambda k: (-law[k], k))
            if top_as == "top":
                token = order[0]
            elif top_as == "not top":
                token = order[1 + rng.randrange(len(order) - 1)]
            if token not in law:
                raise AssertionError(f"position {t}: drew {token}, outside the law {law}")
            below = sum(law[k] for k in order[:order.index(token)])
            values.append(below + rng.random() * law[token])
            positions.append(t)
    return values, positions


def uniformity_p_value(values: list[float], bins: int = 10) -> float:
    """Pearson's test that `values` are uniform on [0, 1), over `bins` equal bins."""
    counts = {b: 0 for b in range(bins)}
    for u in values:
        counts[min(int(u * bins), bins - 1)] += 1
    return chi_square_p_value(counts, {b: 1 / bins for b in range(bins)})
