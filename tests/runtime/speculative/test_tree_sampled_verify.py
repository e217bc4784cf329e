"""beam-sampled-verify: a speculative verify step with sampled requests, against the vllm-gaudi tree
named by GAUDI_FIXES_ROOT (skipped without it).

As in test_tree_grammar_verify.py, HPUModelRunner.sample_tokens runs from the decode forward
through the read-back of the sampled tokens from the (patched or v0.30.0-only) file itself, with
the file's own _prepare_spec_decode_inputs, _run_sampling and _generate_req_id_output_token_ids_lst
(the metadata's padding), vLLM 0.30.0's real RejectionSampler and Sampler, and vllm-gaudi's own
greedy rejection_sample. Requests carry vllm-gaudi's parameters (greedy: temperature -1.0). Stand-ins
only for what has no CPU form: the model forward, the profiler, htorch.mark_step, `.to("hpu")`.

Drafts on HPU carry no draft probabilities (the runner passes draft_probs=None: ngram and EAGLE
drafts are point masses), so the statistics are for point-mass drafts.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.support.gaudi.source import RUNNER_CLS, load, run_statements
from tests.support.gaudi.tree import port_tree_fixture
from tests.support.gaudi.verify import HostTensor, masked_argmax, pack, sample_tokens_statements, use_tree_rejection_sample

pytestmark = pytest.mark.gaudi_tree
tree = port_tree_fixture()

K = 2
STRIDE = K + 1
GREEDY = -1.0  # vllm-gaudi's temperature of a greedy request (hpu_input_batch.py)


def request(temperature=GREEDY, top_p=1.0, top_k=0, seed=None):
    return SimpleNamespace(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)


def sampling_metadata(requests, padded_ids, vocab, rows_of):
    """vLLM's SamplingMetadata as vllm-gaudi's make_selective_sampling_metadata builds it for the
    (padded) request list the tree's _generate_req_id_output_token_ids_lst returned."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    index = [rows_of[r] for r, _ in padded_ids]
    reqs = [requests[i] for i in index]
    n = len(reqs)
    top_k = [r.top_k if 0 < r.top_k < vocab else vocab for r in reqs]
    return SamplingMetadata(
        temperature=torch.tensor([r.temperature for r in reqs], dtype=torch.float32),
        all_greedy=all(r.temperature < 0 for r in requests), all_random=all(r.temperature > 0 for r in requests),
        top_p=None if all(r.top_p >= 1 for r in requests) else torch.tensor([r.top_p for r in reqs]),
        top_k=None if all(k == vocab for k in top_k) else torch.tensor(top_k, dtype=torch.int32),
        generators={i: requests[j].generator for i, j in enumerate(index) if requests[j].generator is not None},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors())


def run_step(tree, monkeypatch, requests, logits, drafts, *, model_type="beam", grammar=None):
    """The decode branch of sample_tokens on one verify step: `logits` [B*(K+1), V] in the verify
    layout (sequence b at b*(K+1)), `drafts[b]` sequence b's drafts (at most K). Returns each
    sequence's emitted tokens. `grammar`: (bitmask, structured_output_request_ids)."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from beam_hpu.runtime.speculative import hpu_sampled_verify as sampled_verify

    use_tree_rejection_sample(tree.root, monkeypatch)
    real_verify_step = sampled_verify.verify_step

    def on_host(out):  # the runner keeps the verified tokens on the card: `.to("hpu")` stays here
        return type(out)(sampled_token_ids=out.sampled_token_ids.as_subclass(HostTensor),
                         logprobs_tensors=out.logprobs_tensors)

    monkeypatch.setattr(sampled_verify, "verify_step", lambda *a: on_host(real_verify_step(*a)))
    for r in requests:
        r.generator = None if r.seed is None else torch.Generator().manual_seed(r.seed)

    vocab = logits.shape[1]
    batch = [f"d{b}" for b in range(len(requests))]
    rows_of = {r: i for i, r in enumerate(batch)}
    htorch = SimpleNamespace(core=SimpleNamespace(mark_step=lambda: None))
    token_ids = torch.zeros(len(batch) * STRIDE, 1, dtype=torch.int64)
    for b, row in enumerate(drafts):
        token_ids[b * STRIDE + 1:b * STRIDE + 1 + len(row), 0] = torch.tensor(row, dtype=torch.int64)
    scheduler_output = SimpleNamespace(scheduled_spec_decode_tokens={d: list(row) for d, row in zip(batch, drafts)
                                                                     if row})
    stock_verify = RejectionSampler(Sampler())

    def verify(metadata, draft_probs, logits_in, metadata_rows):
        return on_host(stock_verify(metadata, draft_probs, logits_in, metadata_rows))

    generate = load(tree.runner, "_generate_req_id_output_token_ids_lst", RUNNER_CLS)

    def prepare_sampling(batch_changed, request_ids=None, pad_to=None, logits_reqs=None):
        padded = generate(runner, request_ids, pad_to, logits_reqs)
        return sampling_metadata(requests, padded, vocab, rows_of)

    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=list(batch), req_id_to_index=dict(rows_of), vocab_size=vocab),
        device="cpu", arange_np=np.arange(100000), requests={r: SimpleNamespace(output_token_ids=[]) for r in batch},
        kv_caches=[], is_driver_worker=False, use_async_scheduling=False, use_structured_output=grammar is not None,
        sampler=stock_verify.sampler, _get_model_type=lambda: model_type,
        profiler=SimpleNamespace(get_timestamp_us=lambda: 0, start=lambda *a: None, end=lambda: None, enabled=False,
                                 record_event=lambda *a: contextlib.nullcontext()),
        _configure_lora=lambda *a: (None, None),
        _execute_model_generic=lambda *a, **k: (None, None, None, logits.clone()),
        _prepare_sampling=prepare_sampling)
    runner.rejection_sampler = type("Verify", (), {
        "__call__": staticmethod(verify), "parse_output": staticmethod(RejectionSampler.parse_output),
        "sampler": stock_verify.sampler, "use_fp64_gumbel": False})()
    cumsum = load(tree.runner, "_get_cumsum_and_arange", RUNNER_CLS, np=np)
    run_sampling = load(tree.runner, "_run_sampling", RUNNER_CLS, htorch=htorch)
    runner._get_cumsum_and_arange = lambda *a, **k: cumsum(runner, *a, **k)
    runner._run_sampling = lambda *a, **k: run_sampling(runner, *a, **k)
    prepare_spec = load(tree.runner, "_prepare_spec_decode_inputs", RUNNER_CLS, np=np, torch=torch,
                        SpecDecodeMetadata=SpecDecodeMetadata)
    logits_indices, spec_metadata = prepare_spec(runner, scheduler_output, torch.arange(len(batch)), token_ids, STRIDE)

    names = dict(
        self=runner, htorch=htorch, torch=torch, np=np, num_decodes=len(batch), num_prefills=0, warmup_mode=False,
        batch_changed=False, dummy_decode_input_data_across_dp=None, scheduler_output=scheduler_output,
        grammar_output=None if grammar is None else SimpleNamespace(grammar_bitmask=grammar[0],
                                                                    structured_output_request_ids=grammar[1]),
        pd_info=SimpleNamespace(decode_req_ids=list(batch), prompt_req_ids=[]),
        decode_data=SimpleNamespace(token_ids=token_ids, position_ids=None, attn_metadata=None,
                                    logits_indices=logits_indices, spec_decode_metadata=spec_metadata,
                                    num_decodes=len(batch)),
        logits_prompt=[], logits_decode=[], prefill_sampled_token_ids=[], prefill_sampled_requests=[],
        decode_sampled_token_ids=[], decode_sampled_requests=[], logprobs_segments=[], spec_decode_num_tokens=None,
        decode_sampled_token_ids_device=None)
    run_statements(sample_tokens_statements(tree.runner, tree.port), tree.runner, names)
    return [names["postprocessed_sampled_token_ids"][i] for i in range(len(batch))]


# ------------------------------------------------------------------------ the target, by definition

def target_distribution(logits_row: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0):
    """What sampling one token gives: softmax(logits / T), cut to the top_k most likely and then
    to the smallest most-likely set holding top_p of the mass, renormalised."""
    p = torch.softmax(logits_row.double() / temperature, dim=-1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, t in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        keep[t] = True
        mass += float(p[t])
    p = torch.where(keep, p, torch.zeros_like(p))
    return p / p.sum()


def total_variation(tokens: list[int], p: torch.Tensor) -> float:
    freq = torch.bincount(torch.tensor(tokens), minlength=len(p)).double() / len(tokens)
    return 0.5 * float((freq - p).abs().sum())


# Target logits at positions 0 and 1 of every sequence (V = 8), and the draft at position 0, the
# target's most likely token: temperature 0.7 / top_p 0.99 (Beam's recommendation) cut tokens 6, 7.
ROW0 = torch.tensor([2.0, 1.4, 1.0, 0.6, 0.2, -0.2, -3.0, -3.5])
ROW1 = torch.tensor([0.3, 1.5, -0.5, 1.0, 0.0, 0.8, -2.5, -4.0])
N = 3000
# sampling N tokens from p: E[TV] is about 0.5 * sum(sqrt(2 p (1 - p) / (pi N))) < 0.015 here;
# the bound is over 3 times that, and both broken samplers below sit more than 8 times above it.
TV_BOUND = 0.05


def sampled_case(temperature=0.7, top_p=0.99, top_k=0, seed=None):
    requests = [request(temperature, top_p, top_k, None if seed is None else seed + b) for b in range(N)]
    logits = torch.zeros(N * STRIDE, len(ROW0))
    logits[0::STRIDE], logits[1::STRIDE] = ROW0, ROW1
    logits[2::STRIDE] = torch.randn(N, len(ROW0), generator=torch.Generator().manual_seed(3))
    draft0, draft1 = 0, 1
    return requests, logits, [[draft0, draft1]] * N


@pytest.mark.parametrize("params", [dict(temperature=0.7, top_p=0.99), dict(temperature=1.3, top_k=3)],
                         ids=["T0.7-top_p0.99", "T1.3-top_k3"])
def test_sampled_rows_emit_the_target_distribution(tree, monkeypatch, params):
    requests, logits, drafts = sampled_case(**params)
    if not tree.port:
        # vllm-gaudi stock: the bonus rows' Sampler gets metadata padded to the step's B*(K+1) rows
        # and cannot divide B rows by B*(K+1) temperatures (had it passed, rejection_sample asserts
        # all_greedy): a sampled request stops the engine
        with pytest.raises(RuntimeError, match=f"size of tensor a \\({N}\\) must match the size of tensor b "
                                               f"\\({N * STRIDE}\\)"):
            run_step(tree, monkeypatch, requests, logits, drafts)
        return
    torch.manual_seed(11)
    out = run_step(tree, monkeypatch, requests, logits, drafts)
    p0 = target_distribution(ROW0, **params)
    p1 = target_distribution(ROW1, **params)
    first = [row[0] for row in out]
    assert total_variation(first, p0) < TV_BOUND, (total_variation(first, p0), p0)
    # The second token, of the sequences whose first draft was accepted, follows position 1's target.
    second = [row[1] for row in out if row[0] == drafts[0][0]]
    assert len(second) > 1000
    assert total_variation(second, p1) < 2 * TV_BOUND
    # Negative controls under the same statistic: a verifier accepting every draft emits the draft;
    # one rejecting every draft emits from p0 without it.
    g = torch.Generator().manual_seed(5)
    accept_all = [drafts[0][0]] * N
    residual = p0.clone()
    residual[drafts[0][0]] = 0
    reject_all = torch.multinomial(residual, N, replacement=True, generator=g).tolist()
    assert total_variation(accept_all, p0) > 8 * TV_BOUND
    assert total_variation(reject_all, p0) > 8 * TV_BOUND


def test_other_models_keep_the_stock_verify_step(tree, monkeypatch):
    """The unit acts for model type beam only: another model's sampled verify step fails as stock."""
    requests, logits, drafts = sampled_case()
    with pytest.raises(RuntimeError, match="must match the size"):
        run_step(tree, monkeypatch, requests[:4], logits[:4 * STRIDE], drafts[:4], model_type="llama")


def greedy_by_definition(logits_rows: torch.Tensor, drafts: list[int]) -> list[int]:
    """Greedy speculative decoding: accept each draft while it is the target's argmax, then the
    argmax there (or the bonus argmax after the last accepted draft)."""
    out = []
    for i, d in enumerate(drafts):
        out.append(int(logits_rows[i].argmax()))
        if d != out[-1]:
            return out
    return out + [int(logits_rows[len(drafts)].argmax())]


def mixed_case():
    """Greedy rows, sampled rows and top_k=1 sampled rows (a point-mass target: their verification
    is greedy's), with K, fewer or no drafts; the bonus row of a sequence sits after its drafts."""
    g = torch.Generator().manual_seed(21)
    kinds = ["greedy", "sampled", "top1", "greedy", "top1", "sampled", "greedy", "top1", "greedy"]
    counts = [2, 2, 2, 1, 1, 1, 0, 0, 2]
    vocab = 16
    logits = torch.randn(len(kinds) * STRIDE, vocab, generator=g) * 2
    requests, drafts = [], []
    for b, (kind, n) in enumerate(zip(kinds, counts)):
        rows = logits[b * STRIDE:b * STRIDE + n + 1]
        argmax = [int(r.argmax()) for r in rows]
        row = argmax[:n]  # all accepted for even b; odd b's last draft is another token
        if b % 2 and n:
            row[-1] = (row[-1] + 1) % vocab
        drafts.append(row)
        requests.append(request() if kind == "greedy" else request(0.8, top_k=1 if kind == "top1" else 0))
        logits[b * STRIDE + n + 1:(b + 1) * STRIDE] = 0  # layout padding rows
    return kinds, requests, logits, drafts


def test_greedy_rows_of_a_mixed_batch_are_the_stock_greedy_verify(tree, monkeypatch):
    kinds, requests, logits, drafts = mixed_case()
    greedy = [b for b, kind in enumerate(kinds) if kind == "greedy"]
    alone = run_step(tree, monkeypatch, [requests[b] for b in greedy],
                     torch.cat([logits[b * STRIDE:(b + 1) * STRIDE] for b in greedy]), [drafts[b] for b in greedy])
    # stock and port alike on an all-greedy batch: greedy speculative decoding by its definition
    assert alone == [greedy_by_definition(logits[b * STRIDE:(b + 1) * STRIDE], drafts[b]) for b in greedy]
    if not tree.port:
        return
    mixed = run_step(tree, monkeypatch, requests, logits, drafts)
    assert [mixed[b] for b in greedy] == alone
    for b, kind in enumerate(kinds):
        rows = logits[b * STRIDE:(b + 1) * STRIDE]
        if kind == "top1":  # sampled through the new path, fewer drafts included: greedy's tokens
            assert mixed[b] == greedy_by_definition(rows, drafts[b]), b
        if kind == "sampled":  # a prefix of the drafts, then one token
            n = len(mixed[b]) - 1
            assert 0 <= n <= len(drafts[b]) and mixed[b][:n] == drafts[b][:n]


def test_seeded_requests_reproduce(tree, monkeypatch):
    """Seeded rows draw from their own generators (vLLM's uniforms, our recovery noise, the
    Sampler's bonus draw): the same seeds give the same tokens whatever the global stream; the
    unseeded rows of the same batch follow the global stream."""
    if not tree.port:
        return
    requests, logits, drafts = sampled_case(temperature=1.5, top_p=1.0)
    n = 200
    seeded = lambda: [request(1.5, seed=100 + b) if b % 2 == 0 else request(1.5) for b in range(n)]  # noqa: E731
    runs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        runs.append(run_step(tree, monkeypatch, seeded(), logits[:n * STRIDE], drafts[:n]))
    even = [[run[b] for b in range(0, n, 2)] for run in runs]
    odd = [[run[b] for b in range(1, n, 2)] for run in runs]
    assert even[0] == even[1]
    assert odd[0] != odd[1]
    other = [request(1.5, seed=900 + b) if b % 2 == 0 else request(1.5) for b in range(n)]
    torch.manual_seed(1)
    third = run_step(tree, monkeypatch, other, logits[:n * STRIDE], drafts[:n])
    assert [third[b] for b in range(0, n, 2)] != even[0]


def test_sampled_rows_under_the_grammar_follow_the_masked_target(tree, monkeypatch):
    """beam-grammar-verify masks every verify row with its grammar row, then the verify above runs:
    a sampled row never emits a token its grammar forbids (a forbidden draft included), and its
    first token follows the target restricted to the grammar's tokens."""
    if not tree.port:
        return
    vocab, n = 32, 2000
    g = torch.Generator().manual_seed(8)
    row0 = torch.randn(vocab, generator=g)
    allowed0 = set(row0.argsort(descending=True)[1:7].tolist())  # the target's argmax is forbidden
    forbidden_draft = int(row0.argmax())
    allowed = [allowed0, set(range(vocab)), set(range(vocab))]
    logits = torch.randn(n * STRIDE, vocab, generator=g)
    logits[0::STRIDE] = row0
    drafts = [[forbidden_draft, 3] if b % 2 == 0 else [sorted(allowed0)[0], 3] for b in range(n)]
    requests = [request(1.0) for _ in range(n)]
    ids = [f"d{b}" for b in range(n)]
    bitmask = pack([s for _ in ids for s in allowed], 64)  # two words a row, the second unused
    torch.manual_seed(4)
    out = run_step(tree, monkeypatch, requests, logits, drafts, grammar=(bitmask, ids))
    first = [row[0] for row in out]
    assert set(first) <= allowed0
    p0 = torch.softmax(row0.double(), -1) * torch.tensor([t in allowed0 for t in range(vocab)])
    assert total_variation(first, p0 / p0.sum()) < TV_BOUND
    assert masked_argmax(row0, allowed0) != forbidden_draft
