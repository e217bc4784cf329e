"""`draft_sample_method: probabilistic` for Beam's DFlash2 drafter: the selector's walk sampled
(beam_hpu.model.dflash2_ops.sampled_walk), the CPU proposer handing verification the
distributions its drafts were drawn from, and the Gaudi proposer's step sampling as it does.

The walk's law is stated here independently of how it is drawn: the first drafted position's
candidate a with probability softmax(S[0, 0] / T)[a] (every predecessor there is the bonus
token), the second's b given a with softmax(S[1, a] / T)[b]. Many walks over the same scores
must follow that joint law by a chi-square test, which rejects the greedy walk's counts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from beam_hpu.model.dflash2_ops import greedy_walk, sampled_walk
from tests.support.dflash2_proposers import cpu_propose, cpu_proposer
from tests.support.dflash2_served import tiny_dflash2
from tests.support.sampling_law import chi_square_p_value

K, T, WALKS, ALPHA = 3, 0.7, 20000, 1e-4


@pytest.fixture
def scores():
    g = torch.Generator().manual_seed(11)
    one = torch.randn(1, 2, K, K, generator=g) * 1.5  # [R, N, predecessor, candidate]
    ids = torch.tensor([[[10, 11, 12], [20, 21, 22]]])
    return one, ids


def joint_law(one: torch.Tensor) -> torch.Tensor:
    first = (one[0, 0, 0] / T).softmax(-1)  # [K]
    return first[:, None] * (one[0, 1] / T).softmax(-1)  # [a, b]


def as_cells(counts: torch.Tensor, law: torch.Tensor) -> tuple[dict, dict]:
    return dict(enumerate(counts.flatten().tolist())), dict(enumerate(law.flatten().tolist()))


def counts_of(tokens: torch.Tensor) -> torch.Tensor:
    counts = torch.zeros(K, K, dtype=torch.float64)
    for (a, b), n in zip(*torch.unique(tokens - torch.tensor([10, 20]), dim=0, return_counts=True)):
        counts[a, b] = n
    return counts


def test_many_sampled_walks_follow_the_chain_law(scores):
    one, ids = scores
    g = torch.Generator().manual_seed(5)
    noise = torch.empty(WALKS, 2, K).exponential_(generator=g)
    tokens, dists = sampled_walk(one.expand(WALKS, -1, -1, -1), ids.expand(WALKS, -1, -1),
                                 torch.full((WALKS,), T), noise)
    law = joint_law(one)
    assert chi_square_p_value(*as_cells(counts_of(tokens), law)) >= ALPHA
    # what each walk was drawn from: the first row, then its pick's row
    torch.testing.assert_close(dists[:, 0], (one[0, 0, 0] / T).softmax(-1).expand(WALKS, K))
    torch.testing.assert_close(dists[:, 1], (one[0, 1, tokens[:, 0] - 10] / T).softmax(-1))
    # the same test refuses the greedy walk's counts: it can tell a draw from the argmax
    greedy, _ = greedy_walk(one.expand(WALKS, -1, -1, -1), ids.expand(WALKS, -1, -1))
    assert chi_square_p_value(*as_cells(counts_of(greedy), law)) < ALPHA


def test_a_greedy_request_in_the_batch_walks_greedily(scores):
    one, ids = scores
    both = one.expand(2, -1, -1, -1)
    tokens, dists = sampled_walk(both, ids.expand(2, -1, -1), torch.tensor([0.0, T]),
                                 torch.empty(2, 2, K).exponential_(generator=torch.Generator().manual_seed(1)))
    greedy, _ = greedy_walk(one, ids)
    assert torch.equal(tokens[0], greedy[0])
    assert torch.equal(dists[0], torch.nn.functional.one_hot(greedy[0] - torch.tensor([10, 20]), K).float())


@pytest.fixture
def vllm_config():
    # vLLM's layers ask for the current config when built and run.
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def _sampling(temperature, generators=None):
    return SimpleNamespace(all_greedy=bool((torch.tensor(temperature) == 0).all()), temperature=torch.tensor(temperature),
                           generators=generators or {})


def _run(model, sampling, sample_walks=True):
    width = model.model.fc.input_size
    g = torch.Generator().manual_seed(0)
    states = torch.randn(9, width, generator=g)
    with torch.no_grad():
        p = cpu_proposer(model, ["a", "b"], window=4096, sample_walks=sample_walks)
        drafts = cpu_propose(p, 7, [5, 4], torch.cat([torch.arange(5), torch.arange(4)]), states,
                             torch.tensor([3, 4]), sampling=sampling)
    return drafts, p._last_draft_probs


def test_the_cpu_proposer_hands_verification_what_its_drafts_were_drawn_from(vllm_config):
    """Request a greedy, b sampled (seeded): [R, k, V] draft probabilities, each row a distribution
    over that position's candidates only, the greedy request's one-hot at its draft, every draft of
    b drawn where its row gives it mass; b's seed repeats its drafts."""
    model = tiny_dflash2()
    vocab = model.config.vocab_size
    drafts, probs = _run(model, _sampling([0.0, 1.0], {1: torch.Generator().manual_seed(9)}))
    assert probs.shape == (2, 7, vocab)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 7))
    assert ((probs > 0).sum(-1) <= model.model.candidate_selector.top_k).all()
    assert torch.equal(probs[0], torch.nn.functional.one_hot(drafts[0], vocab).float())
    assert (probs[1].gather(-1, drafts[1][:, None]) > 0).all()
    greedy, none = _run(model, None)
    assert none is None and torch.equal(drafts[0], greedy[0])
    again, _ = _run(model, _sampling([0.0, 1.0], {1: torch.Generator().manual_seed(9)}))
    assert torch.equal(again, drafts)
    # a hot enough walk leaves the greedy path somewhere (else the sampling above proved nothing)
    hot = [_run(model, _sampling([0.0, 5.0], {1: torch.Generator().manual_seed(s)}))[0][1] for s in range(8)]
    assert any(not torch.equal(h, greedy[1]) for h in hot)


def test_an_all_greedy_batch_or_greedy_method_hands_no_probabilities(vllm_config):
    model = tiny_dflash2()
    greedy, _ = _run(model, None)
    for sampling, enabled in ((_sampling([0.0, 0.0]), True), (_sampling([1.0, 1.0]), False)):
        drafts, probs = _run(model, sampling, sample_walks=enabled)
        assert probs is None and torch.equal(drafts, greedy)


def test_the_gaudi_step_samples_as_the_cpu_proposer(vllm_config):
    """The Gaudi proposer's step with `draft_sample_method: probabilistic`, on the same prefill of a
    greedy request and a seeded sampled one, with its temperatures read from vllm-gaudi's input
    batch (-1 for greedy) and its padding rows: the drafts of the CPU proposer, whose noise is
    drawn the same way; with the greedy method the sampled request drafts the greedy walk."""
    import numpy as np

    from tests.support.dflash2_proposers import Runner, hpu_prefill, hpu_proposer

    model = tiny_dflash2()
    n_states = len(model.config.dflash_config["target_layer_ids"])
    width = model.model.fc.input_size
    g = torch.Generator().manual_seed(0)
    rows = {"a": (0, torch.randn(5, width, generator=g)), "b": (0, torch.randn(4, width, generator=g))}
    with torch.no_grad():
        cpu = cpu_proposer(model, ["a", "b"], sample_walks=True)
        expected = cpu_propose(cpu, 7, [5, 4], torch.cat([torch.arange(5), torch.arange(4)]),
                               torch.cat([rows["a"][1], rows["b"][1]]), torch.tensor([3, 4]),
                               sampling=_sampling([0.0, 1.0], {1: torch.Generator().manual_seed(9)}))
        drafts = {}
        for method in ("probabilistic", "greedy"):
            gaudi = hpu_proposer(model, 7)
            gaudi.sample_walks = method == "probabilistic"
            runner = Runner(["a", "b"])
            runner.input_batch.temperature_cpu = np.array([-1.0, 1.0], dtype=np.float32)
            runner.input_batch.generators = {1: torch.Generator().manual_seed(9)}
            drafts[method] = hpu_prefill(gaudi, runner, rows, {"a": 3, "b": 4}, n_states)
    assert torch.equal(drafts["probabilistic"], expected)
    assert torch.equal(drafts["greedy"][0], expected[0])
    assert not torch.equal(drafts["greedy"][1], expected[1])  # b's sampled walk left the greedy one
