"""Verification of drafted tokens (beam_hpu.runtime.speculative.rejection_sampling, the functions the CPU
patch cpu-rejection-sampler and the Gaudi unit beam-sampled-verify call) against the definition
of speculative sampling, written here as a plain per-request loop.

Greedy and the random accept rule are compared exactly (given uniforms and given recovered
tokens); the recovered draws and the emitted token's distribution statistically, with fixed seeds
and bounds of several standard errors. Then vLLM's own RejectionSampler runs through the patch.
"""

from __future__ import annotations

import pytest
import torch

from beam_hpu.runtime.speculative import rejection_sampling as rs
from tests.support.spec_decode import sampling_metadata, spec_metadata

P = rs.PLACEHOLDER


def reference(drafts: list[list[int]], max_spec_len: int, target_probs: list[torch.Tensor],
              bonus: list[int], greedy: list[bool], uniforms: list[list[float]] | None = None,
              draft_probs: list[torch.Tensor] | None = None,
              recovered: list[list[int]] | None = None) -> list[list[int]]:
    """Speculative sampling by its definition, one request at a time; target_probs[b] is [n_b, V].
    Greedy: accept while the draft is the target's argmax, then the argmax; random: accept with
    probability min(1, p/q) (q = 1 without draft probs), then the given recovered token."""
    rows = []
    for b, row_drafts in enumerate(drafts):
        out = []
        for i, d in enumerate(row_drafts):
            p = target_probs[b][i]
            if greedy[b]:
                if d == int(p.argmax()):
                    out.append(d)
                    continue
                out.append(int(p.argmax()))
                break
            q = 1.0 if draft_probs is None else float(draft_probs[b][i][d]) if d >= 0 else 0.0
            if d >= 0 and q > 0 and float(p[d]) > 0 and uniforms[b][i] <= min(1.0, float(p[d]) / q):
                out.append(d)
                continue
            out.append(recovered[b][i])
            break
        else:
            out.append(bonus[b])
        rows.append(out + [P] * (max_spec_len + 1 - len(out)))
    return rows


def flat(drafts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([d for row in drafts for d in row], dtype=torch.int32)
    cu = torch.tensor([len(r) for r in drafts], dtype=torch.int32).cumsum(0).to(torch.int32)
    return ids, cu


def random_case(seed: int, batch: int = 7, vocab: int = 6, max_spec_len: int = 4, match: float = 0.6):
    g = torch.Generator().manual_seed(seed)
    lengths = [int(torch.randint(0, max_spec_len + 1, (1,), generator=g)) for _ in range(batch)]
    lengths[0] = max_spec_len
    probs = [torch.softmax(torch.randn(n, vocab, generator=g) * 2, -1) for n in lengths]
    drafts = []
    for b, n in enumerate(lengths):
        row = []
        for i in range(n):
            if torch.rand(1, generator=g) < match:
                row.append(int(probs[b][i].argmax()))
            elif torch.rand(1, generator=g) < 0.2:
                row.append(-1)  # a padded draft: always rejected
            else:
                row.append(int(torch.randint(0, vocab, (1,), generator=g)))
        drafts.append(row)
    bonus = [int(torch.randint(0, vocab, (1,), generator=g)) for _ in range(batch)]
    return drafts, probs, bonus, g


@pytest.mark.parametrize("seed", range(6))
def test_greedy_rows_match_the_definition(seed):
    drafts, probs, bonus, _ = random_case(seed)
    ids, cu = flat(drafts)
    logits = torch.cat(probs).log()
    out = rs.verify(ids, [len(r) for r in drafts], 4, cu, None, logits, torch.tensor(bonus)[:, None],
                    all_greedy=True, all_random=False, temperature=None, generators={}, uniform_probs=None)
    assert out.dtype == torch.int32
    assert out.tolist() == reference(drafts, 4, probs, bonus, [True] * len(drafts))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_random_accept_rule_matches_the_definition_for_given_uniforms(seed, with_draft_probs):
    """The padded verification against the definition, for given uniforms and noise; the
    recovered token at each slot is the unit's draw from that noise (its distribution is tested
    below), so this checks the accept rule, the first rejection and the bonus exactly."""
    drafts, probs, bonus, g = random_case(seed, match=0.4)
    ids, cu = flat(drafts)
    counts = [len(r) for r in drafts]
    batch, width, vocab = len(drafts), 4, probs[0].shape[-1]
    n = ids.shape[0]
    uniform = torch.rand(n, generator=g, dtype=torch.float64)
    q = torch.softmax(torch.randn(n, vocab, generator=g), -1) if with_draft_probs else None
    noise = torch.empty(batch, vocab).exponential_(generator=g)
    greedy = [bool(x) for x in torch.rand(batch, generator=g) < 0.3]
    index = rs.padded_index(counts, width)
    target = torch.cat(probs)
    padded_q = None if q is None else q[index]
    out = rs.verify_padded(ids[index].reshape(batch, width), torch.tensor(counts), target.log()[index],
                           torch.tensor(bonus), greedy=torch.tensor(greedy),
                           uniform_probs=uniform[index].reshape(batch, width), noise=noise, draft_probs=padded_q)
    recovered = rs.recovered_tokens(ids[index].reshape(batch, width),
                                    None if q is None else padded_q.reshape(batch, width, vocab),
                                    target[index].reshape(batch, width, vocab), noise)

    def per_request(t):
        return None if t is None else list(torch.split(t, counts))

    expected = reference(drafts, 4, probs, bonus, greedy, [u.tolist() for u in per_request(uniform)],
                         per_request(q), [recovered[b, :counts[b]].tolist() for b in range(batch)])
    assert out.dtype == torch.int32
    assert out.tolist() == expected


def test_the_flattened_layout_is_the_padded_verification():
    """`verify` (vLLM's flattened layout, the CPU path) emits what `verify_padded` emits for the
    same drafts, uniforms and noise: one implementation of the rule."""
    drafts, probs, bonus, g = random_case(7, match=0.5)
    ids, cu = flat(drafts)
    counts = [len(r) for r in drafts]
    batch, width, vocab = len(drafts), 4, probs[0].shape[-1]
    uniform = torch.rand(ids.shape[0], generator=g, dtype=torch.float64)
    temperature = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    logits = torch.cat(probs).log()
    torch.manual_seed(5)
    flat_out = rs.verify(ids, counts, width, cu, None, logits, torch.tensor(bonus)[:, None], all_greedy=False,
                         all_random=False, temperature=temperature, generators={}, uniform_probs=uniform)
    torch.manual_seed(5)
    noise = torch.empty(batch, vocab).exponential_()
    index = rs.padded_index(counts, width)
    padded_out = rs.verify_padded(ids[index].reshape(batch, width), torch.tensor(counts), logits[index],
                                  torch.tensor(bonus), greedy=temperature == 0,
                                  uniform_probs=uniform[index].reshape(batch, width), noise=noise)
    assert torch.equal(flat_out, padded_out)


def test_the_accept_rule_at_its_boundary():
    """u == p/q accepts (u <= min(1, p/q)); q(d) == 0 rejects; p/q above 1 always accepts."""
    p = torch.tensor([[0.25, 0.75], [0.5, 0.5], [0.9, 0.1]])
    q = torch.tensor([[0.5, 0.5], [0.0, 1.0], [0.3, 0.7]])
    accepted = rs.random_accepts(torch.tensor([0, 0, 0]), q, p, torch.tensor([0.5, 0.0, 0.999], dtype=torch.float64))
    assert accepted.tolist() == [True, False, True]
    above = rs.random_accepts(torch.tensor([0]), q[:1], p[:1], torch.tensor([0.5 + 1e-9], dtype=torch.float64))
    assert above.tolist() == [False]
    # p(d) == 0 (a token the grammar masked) rejects even for u == 0, which would pass u <= p/q.
    masked = rs.random_accepts(torch.tensor([1, 1]), None, torch.tensor([[1.0, 0.0], [0.5, 0.5]]),
                               torch.tensor([0.0, 0.0], dtype=torch.float64))
    assert masked.tolist() == [False, True]


def tolerance(expected: torch.Tensor, n: int) -> torch.Tensor:
    return 5 * (expected * (1 - expected) / n).sqrt() + 2e-3


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_recovered_tokens_are_drawn_from_the_normalised_residual(with_draft_probs):
    n, vocab = 40000, 5
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.1, 0.35, 0.05, 0.3, 0.2])
    q = torch.tensor([0.3, 0.1, 0.05, 0.35, 0.2])
    drafts = torch.full((n,), 3, dtype=torch.int32)
    noise = torch.empty(n, vocab).exponential_(generator=g)
    got = rs.recovered_tokens(drafts[:, None], q.expand(n, 1, vocab) if with_draft_probs else None,
                              p.expand(n, 1, vocab), noise)[:, 0]
    residual = (p - q).clamp(min=0) if with_draft_probs else p.clone().index_fill_(0, torch.tensor([3]), 0)
    expected = residual / residual.sum()
    freq = torch.bincount(got.long(), minlength=vocab).double() / n
    assert ((freq - expected).abs() <= tolerance(expected.double(), n)).all(), (freq, expected)


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_emitted_tokens_are_distributed_as_the_target(with_draft_probs):
    """Losslessness: drafts from q, verified against p, emit a first token distributed as p and
    accept the first draft with probability sum(min(p, q))."""
    n, vocab, k = 30000, 5, 2
    g = torch.Generator().manual_seed(2)
    p = torch.tensor([[0.1, 0.35, 0.05, 0.3, 0.2], [0.4, 0.1, 0.1, 0.2, 0.2]])
    q = torch.tensor([[0.3, 0.1, 0.05, 0.35, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]])
    if with_draft_probs:
        drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(k)], 1)
    else:  # ngram-like: a fixed draft, q its point mass
        drafts = torch.tensor([3, 0]).expand(n, k)
        q = torch.nn.functional.one_hot(drafts[0], vocab).double()
    ids = drafts.reshape(-1).to(torch.int32)
    cu = torch.arange(k, n * k + 1, k, dtype=torch.int32)
    logits = p.log().repeat(n, 1)
    bonus = torch.randint(0, vocab, (n, 1), generator=g)
    uniform = torch.rand(n * k, generator=g, dtype=torch.float64)
    torch.manual_seed(3)  # the recovery noise of unseeded requests comes from the global stream
    out = rs.verify(ids, [k] * n, k, cu, q.float().repeat(n, 1) if with_draft_probs else None, logits,
                    bonus, all_greedy=False, all_random=True, temperature=torch.ones(n), generators={},
                    uniform_probs=uniform)
    first = out[:, 0].long()
    freq = torch.bincount(first, minlength=vocab).double() / n
    assert ((freq - p[0]).abs() <= tolerance(p[0].double(), n)).all(), (freq, p[0])
    accept_rate = (first == drafts[:, 0]).double().mean()
    expected_rate = torch.minimum(p[0].double(), q[0].double()).sum()
    assert abs(accept_rate - expected_rate) <= tolerance(expected_rate, n)
    # Every row holds a prefix of tokens then placeholders only.
    emitted = out != P
    assert torch.equal(emitted, torch.cumprod(emitted.int(), 1).bool())


def test_seeded_requests_draw_their_own_recovery_noise():
    a = rs.recovery_noise([2, 0, 3], 8, {0: torch.Generator().manual_seed(5), 1: torch.Generator().manual_seed(6)})
    b = rs.recovery_noise([2, 0, 3], 8, {0: torch.Generator().manual_seed(5)})
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[0], torch.empty(8).exponential_(generator=torch.Generator().manual_seed(5)))


def test_expand_per_request_matches_the_definition():
    values = torch.tensor([0.0, 0.7, 0.0, 1.3])
    cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32)
    got = rs.expand_per_request(values, cu, 6, replace_from=0, replace_to=1)
    assert got.tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0, 1.0, 1.3])
    assert got.dtype == values.dtype
    ints = rs.expand_per_request(torch.tensor([5, 9], dtype=torch.int64), torch.tensor([1, 4]), 4)
    assert ints.tolist() == [5, 9, 9, 9]


# --- vLLM's own RejectionSampler, through the installed patch -----------------------------------

@pytest.fixture(scope="module")
def vllm_sampler():
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from beam_hpu.runtime.speculative import patch_cpu_rejection_sampler as cpu_rejection_sampler

    cpu_rejection_sampler.install()
    return RejectionSampler(Sampler())


def test_vllm_rejection_sampler_greedy_through_the_patch(vllm_sampler):
    drafts, probs, bonus_unused, g = random_case(11, batch=5)
    meta = spec_metadata(drafts)
    vocab = probs[0].shape[-1]
    bonus_logits = torch.randn(len(drafts), vocab, generator=g)
    rows = []
    for b, p in enumerate(probs):
        rows += [p.log(), bonus_logits[b:b + 1]]
    logits = torch.cat(rows)
    out = vllm_sampler(meta, None, logits.clone(), sampling_metadata([0.0] * len(drafts), vocab))
    expected = reference(drafts, meta.max_spec_len, probs, bonus_logits.argmax(-1).tolist(), [True] * len(drafts))
    assert out.sampled_token_ids.tolist() == expected


def test_vllm_rejection_sampler_mixed_batch_through_the_patch(vllm_sampler):
    """Greedy and random rows in one batch (temperature expanded per token by the patched
    expand_batch_to_tokens): greedy rows follow the definition exactly; random rows emit a
    nonempty prefix of their drafts followed by one token, seeded rows reproducibly."""
    drafts, probs, _, g = random_case(12, batch=6, match=0.9)
    drafts = [[max(d, 0) for d in row] for row in drafts]
    meta = spec_metadata(drafts)
    vocab = probs[0].shape[-1]
    bonus_logits = torch.randn(len(drafts), vocab, generator=g)
    logits = torch.cat([t for b, p in enumerate(probs) for t in (p.log(), bonus_logits[b:b + 1])])
    temperature = [0.0, 1.0, 0.0, 0.7, 1.0, 0.0]

    def run(seed):
        gens = {1: torch.Generator().manual_seed(seed), 3: torch.Generator().manual_seed(seed + 1),
                4: torch.Generator().manual_seed(seed + 2)}
        return vllm_sampler(meta, None, logits.clone(), sampling_metadata(temperature, vocab, gens)).sampled_token_ids

    out = run(100)
    greedy_rows = [b for b, t in enumerate(temperature) if t == 0]
    expected = reference([drafts[b] for b in greedy_rows], meta.max_spec_len, [probs[b] for b in greedy_rows],
                         [int(bonus_logits[b].argmax()) for b in greedy_rows], [True] * len(greedy_rows))
    assert out[greedy_rows].tolist() == expected
    for b, t in enumerate(temperature):
        if t == 0:
            continue
        row = [x for x in out[b].tolist() if x != P]
        assert 1 <= len(row) <= len(drafts[b]) + 1
        assert row[:-1] == drafts[b][:len(row) - 1]
        assert out[b, len(row):].eq(P).all()
    assert torch.equal(out, run(100))


def test_the_stock_sampler_cannot_run_here_without_the_patch(vllm_sampler):
    """The patch's reason: vLLM's own rejection_sample fails on this CPU host."""
    from vllm.v1.sample import rejection_sampler

    stock = rejection_sampler.rejection_sample.__wrapped__
    drafts = [[1, 2]]
    ids, cu = flat(drafts)
    with pytest.raises(TypeError, match="Cannot inspect kernel parameters"):
        stock(ids, [2], 2, cu, None, torch.randn(2, 6), torch.tensor([[0]]), sampling_metadata([0.0], 6))


def test_uniform_draws_are_vllms_stream():
    """Seeded spans equal vLLM's generate_uniform_probs for the same generators (requests without
    drafts skipped); the unseeded draw comes from the global stream as in vLLM."""
    from vllm.v1.sample.rejection_sampler import generate_uniform_probs

    counts = [2, 0, 3, 1]

    def seeded():
        return {0: torch.Generator().manual_seed(4), 1: torch.Generator().manual_seed(5),
                2: torch.Generator().manual_seed(6)}

    torch.manual_seed(9)
    ours = rs.uniform_draws(6, counts, seeded())
    torch.manual_seed(9)
    theirs = generate_uniform_probs(6, counts, seeded(), torch.device("cpu"))
    assert ours.dtype == torch.float64 and torch.equal(ours, theirs)
    # the seeded spans do not depend on the global stream
    torch.manual_seed(10)
    again = rs.uniform_draws(6, counts, seeded())
    assert torch.equal(again[:5], ours[:5]) and not torch.equal(again[5:], ours[5:])
