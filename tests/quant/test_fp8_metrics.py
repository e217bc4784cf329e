import math

import pytest
import torch

from beam_hpu.quant.metrics import kl_divergence, mean_kl, perplexity, perplexity_change, top1_agreement


def logp(*rows):
    return torch.tensor(rows, dtype=torch.float64).log()


def test_kl_of_identical_distributions_is_zero():
    p = logp([0.2, 0.3, 0.5], [0.9, 0.05, 0.05])
    assert kl_divergence(p, p).tolist() == [0.0, 0.0]


def test_kl_hand_computed():
    # KL([.5,.5] || [.25,.75]) = .5 ln 2 + .5 ln(2/3) = .5 ln(4/3)
    ref, test = logp([0.5, 0.5]), logp([0.25, 0.75])
    assert kl_divergence(ref, test).item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-12)
    # KL is not symmetric: KL([.25,.75] || [.5,.5]) = .25 ln .5 + .75 ln 1.5
    assert kl_divergence(test, ref).item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), rel=1e-12)


def test_kl_zero_reference_probability_contributes_nothing():
    ref, test = logp([1.0, 0.0]), logp([0.5, 0.5])  # ref has a -inf log-probability
    assert kl_divergence(ref, test).item() == pytest.approx(math.log(2))
    assert math.isinf(kl_divergence(test, ref).item())


def test_mean_kl_averages_positions():
    ref = logp([0.5, 0.5], [0.5, 0.5])
    test = logp([0.5, 0.5], [0.25, 0.75])
    assert mean_kl(ref, test) == pytest.approx(0.25 * math.log(4 / 3))


def test_top1_agreement_counts_positions():
    ref = logp([0.6, 0.4], [0.1, 0.9], [0.3, 0.7])
    test = logp([0.7, 0.3], [0.8, 0.2], [0.4, 0.6])
    assert top1_agreement(ref, test) == pytest.approx(2 / 3)


def test_perplexity_hand_computed():
    # exp(-(ln .5 + ln .25) / 2) = sqrt(8)
    assert perplexity(torch.tensor([0.5, 0.25]).log()) == pytest.approx(math.sqrt(8))
    assert perplexity(torch.zeros(4)) == pytest.approx(1.0)


def test_perplexity_change_is_relative():
    ref = torch.tensor([0.5, 0.5]).log()  # perplexity 2
    test = torch.tensor([0.25, 0.25]).log()  # perplexity 4
    assert perplexity_change(test, ref) == pytest.approx(1.0)
    assert perplexity_change(ref, test) == pytest.approx(-0.5)


def test_shape_mismatches_are_refused():
    with pytest.raises(ValueError, match="log-probability"):
        kl_divergence(logp([0.5, 0.5]), logp([0.2, 0.3, 0.5]))
    with pytest.raises(ValueError, match="positions differ"):
        perplexity_change(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError):
        perplexity(torch.zeros(0))
