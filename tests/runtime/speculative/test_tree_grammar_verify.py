"""beam-grammar-verify on a speculative verify step that carries a grammar, against the vllm-gaudi
tree named by GAUDI_FIXES_ROOT (skipped without it).

The statements of HPUModelRunner.sample_tokens from the decode forward through the read-back of
the sampled tokens run from the (patched or v0.30.0-only) file itself, with the file's own
_prepare_spec_decode_inputs building the verify metadata and _run_sampling sampling, vLLM 0.30.0's
real RejectionSampler and Sampler, and vllm-gaudi's own greedy rejection_sample (the function the
HPU runs, taken from the tree's hpu_rejection_sampler.py). Stand-ins only for what has no CPU form:
the model forward (it returns the step's logits), the profiler, htorch.mark_step, and `.to("hpu")`.
Each request's output is checked against greedy speculative decoding under the grammar, by its
definition: accept each draft while it is the grammar-masked target's argmax, then emit that argmax
(or the masked bonus argmax when every draft is accepted).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.support.gaudi.source import RUNNER_CLS, HostTorch, load, run_statements
from tests.support.gaudi.verify import HostTensor, masked_argmax, pack, sample_tokens_statements, use_tree_rejection_sample
from tests.support.gaudi.tree import port_tree_fixture

pytestmark = pytest.mark.gaudi_tree
tree = port_tree_fixture()

VOCAB, K = 64, 3
STRIDE = K + 1
DECODES = ["d0", "d1", "d2"]  # d2 has no grammar
LAYOUT_SEQUENCES = 4  # the decode batch padded to a bucket of 4
PROMPT = "p0"
GRAMMAR_IDS = ["p0", "d1", "d0"]  # the scheduler's order


def greedy_metadata(rows: int):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(rows),
        presence_penalties=torch.zeros(rows), repetition_penalties=torch.ones(rows),
        output_token_ids=[[] for _ in range(rows)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors())


def allowed_sets(seed: int, rows: int) -> list[set[int]]:
    rng = np.random.default_rng(seed)
    return [set(rng.choice(VOCAB, size=12, replace=False).tolist()) for _ in range(rows)]


def case():
    """The step: logits in vllm-gaudi's verify layout, drafts, the grammar's rows, the expected tokens."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(LAYOUT_SEQUENCES * STRIDE, VOCAB, generator=g)
    prompt_logits = torch.randn(1, VOCAB, generator=g)
    grammar = {"p0": allowed_sets(1, 1), "d1": allowed_sets(2, STRIDE), "d0": allowed_sets(3, STRIDE), "d2": None}
    rows = {d: logits[b * STRIDE:(b + 1) * STRIDE] for b, d in enumerate(DECODES)}
    # d1's second draft is its row's unmasked argmax, which its grammar forbids: stock would accept it
    grammar["d1"][1].discard(int(rows["d1"][1].argmax()))

    def target(d, i):
        return masked_argmax(rows[d][i], None if grammar[d] is None else grammar[d][i])

    drafts = {
        "d0": [target("d0", i) for i in range(K)],  # all accepted, then the bonus
        "d1": [target("d1", 0), int(rows["d1"][1].argmax()), target("d1", 2)],  # rejected at 1
        "d2": [target("d2", 0), (target("d2", 1) + 1) % VOCAB, 0],  # no grammar: rejected at 1
    }
    expected = {}
    for d in DECODES:
        out = []
        for i, draft in enumerate(drafts[d]):
            out.append(target(d, i))
            if draft != out[-1]:
                break
        else:
            out.append(target(d, K))
        expected[d] = out
    expected[PROMPT] = [masked_argmax(prompt_logits[0], grammar["p0"][0])]
    assert [len(expected[d]) for d in DECODES] == [K + 1, 2, 2]
    bitmask = pack([s for r in GRAMMAR_IDS for s in grammar[r]], VOCAB)
    return logits, prompt_logits, drafts, bitmask, expected


def run_step(tree, monkeypatch, model_type="beam"):
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    use_tree_rejection_sample(tree.root, monkeypatch)

    logits, prompt_logits, drafts, bitmask, expected = case()
    batch = DECODES + [PROMPT]
    htorch = SimpleNamespace(core=SimpleNamespace(mark_step=lambda: None))
    token_ids = torch.zeros(LAYOUT_SEQUENCES * STRIDE, 1, dtype=torch.int64)
    for b, d in enumerate(DECODES):
        token_ids[b * STRIDE + 1:(b + 1) * STRIDE, 0] = torch.tensor(drafts[d])
    scheduler_output = SimpleNamespace(scheduled_spec_decode_tokens=dict(drafts))

    calls = SimpleNamespace(verified=[], sampled=[])
    real_verify = RejectionSampler(Sampler())

    def verify(metadata, draft_probs, logits_in, sampling_metadata):
        calls.verified.append(logits_in.clone())
        out = real_verify(metadata, draft_probs, logits_in, sampling_metadata)
        return replace(out, sampled_token_ids=out.sampled_token_ids.as_subclass(HostTensor))

    def prepare_sampling(batch_changed, request_ids=None, pad_to=None, logits_reqs=None):
        calls.sampled.append((list(request_ids), list(logits_reqs or [])))
        return greedy_metadata(len(logits_reqs) if logits_reqs else pad_to)

    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=list(batch), req_id_to_index={r: i for i, r in enumerate(batch)},
                                    vocab_size=VOCAB),
        device="cpu", arange_np=np.arange(1000), requests={}, kv_caches=[], is_driver_worker=False,
        use_async_scheduling=False, use_structured_output=True, sampler=Sampler(),
        profiler=SimpleNamespace(get_timestamp_us=lambda: 0, start=lambda *a: None, end=lambda: None, enabled=False,
                                 record_event=lambda *a: contextlib.nullcontext()),
        _configure_lora=lambda *a: (None, None), _get_model_type=lambda: model_type,
        _execute_model_generic=lambda *a, **k: (None, None, None, logits.clone()),
        _prepare_sampling=prepare_sampling)
    runner.rejection_sampler = type("Verify", (), {"__call__": staticmethod(verify),
                                                   "parse_output": staticmethod(RejectionSampler.parse_output)})()
    runner._get_cumsum_and_arange = lambda *a, **k: cumsum(runner, *a, **k)
    runner._run_sampling = lambda *a, **k: run_sampling(runner, *a, **k)
    cumsum = load(tree.runner, "_get_cumsum_and_arange", RUNNER_CLS, np=np)
    run_sampling = load(tree.runner, "_run_sampling", RUNNER_CLS, htorch=htorch)
    prepare_spec = load(tree.runner, "_prepare_spec_decode_inputs", RUNNER_CLS, np=np, torch=torch,
                        SpecDecodeMetadata=SpecDecodeMetadata)
    logits_indices, spec_metadata = prepare_spec(runner, scheduler_output, torch.arange(LAYOUT_SEQUENCES),
                                                 token_ids, STRIDE)
    assert spec_metadata.num_draft_tokens == [K, K, K, 0]

    names = dict(
        self=runner, htorch=htorch, torch=torch, np=np, num_decodes=len(DECODES), num_prefills=1, warmup_mode=False,
        batch_changed=False, dummy_decode_input_data_across_dp=None, scheduler_output=scheduler_output,
        grammar_output=SimpleNamespace(grammar_bitmask=bitmask, structured_output_request_ids=GRAMMAR_IDS),
        pd_info=SimpleNamespace(decode_req_ids=list(DECODES), prompt_req_ids=[PROMPT]),
        decode_data=SimpleNamespace(token_ids=token_ids, position_ids=None, attn_metadata=None,
                                    logits_indices=logits_indices, spec_decode_metadata=spec_metadata,
                                    num_decodes=len(DECODES)),
        logits_prompt=[prompt_logits.clone()], logits_decode=[], prefill_sampled_token_ids=[],
        prefill_sampled_requests=[PROMPT], decode_sampled_token_ids=[], decode_sampled_requests=[],
        logprobs_segments=[], spec_decode_num_tokens=None, decode_sampled_token_ids_device=None)
    if not tree.port or model_type != "beam":  # the stock branch masks with xgrammar's CPU kernel
        import xgrammar.kernels.apply_token_bitmask_inplace_cpu as xgr_cpu

        mask = load(tree.runner, "apply_grammar_bitmask", RUNNER_CLS, np=np, torch=HostTorch(), xgr_cpu=xgr_cpu)
        runner.apply_grammar_bitmask = lambda *a: mask(runner, *a)
    run_statements(sample_tokens_statements(tree.runner, tree.port), tree.runner, names)
    out = {r: names["postprocessed_sampled_token_ids"][i] for i, r in enumerate(batch)}
    return out, expected, calls, bitmask, logits


def test_verify_step_under_a_grammar_emits_the_grammar_verified_tokens(tree, monkeypatch):
    if not tree.port:
        # vllm-gaudi's structured-output branch keeps one row per decode (the first rows of the
        # verify logits: d0's positions 0-2) and never verifies; apply_grammar_bitmask then puts
        # each grammar request's 1 + k rows at its spec-offset rows, past the 4 rows kept: the step
        # raises, which stops the engine
        with pytest.raises(IndexError):
            run_step(tree, monkeypatch)
        return
    out, expected, calls, bitmask, logits = run_step(tree, monkeypatch)
    assert out == expected
    # The forbidden draft reached the verifier (no scheduler trim here): d1's second draft is its
    # unmasked row's argmax, so a verifier ignoring the grammar would emit it; it is not emitted
    forbidden = case()[2]["d1"][1]
    assert int(logits[STRIDE + 1].argmax()) == forbidden and out["d1"][1] != forbidden
    # The rejection sampler saw every row of every grammar decode masked with its own grammar row
    # (d0 is bitmask rows 5-8, d1 rows 1-4), d2's and the padding sequence's rows untouched.
    (verified,) = calls.verified
    from beam_hpu.runtime.grammar.hpu_device_mask import apply_token_bitmask

    want = logits.clone()
    for b, first in ((0, 5), (1, 1)):
        block = logits[b * STRIDE:(b + 1) * STRIDE].clone()
        apply_token_bitmask(block, bitmask[first:first + STRIDE])
        want[b * STRIDE:(b + 1) * STRIDE] = block
    assert torch.equal(verified, want)
    # The prompt was sampled alone, with its own parameters
    assert calls.sampled[-1] == ([PROMPT], [PROMPT])


def test_steps_without_drafts_keep_the_stock_branch(tree):
    statements = sample_tokens_statements(tree.runner, tree.port)
    if tree.port:
        beam = SimpleNamespace(_get_model_type=lambda: "beam")
        names = {"grammar_output": object(), "num_decodes": 2, "self": beam,
                 "decode_data": SimpleNamespace(spec_decode_metadata=None)}
        run_statements(statements[:2], tree.runner, names)
        assert names["verify_under_grammar"] is False
        names = {"grammar_output": None, "num_decodes": 2, "self": beam,
                 "decode_data": SimpleNamespace(spec_decode_metadata=1)}
        run_statements(statements[:2], tree.runner, names)
        assert names["verify_under_grammar"] is False


def test_another_model_keeps_the_stock_branch(tree, monkeypatch):
    """The same verify step under a grammar for a llama: the port leaves vllm-gaudi's branch as it
    is (the plugin's image may serve other models), so the step fails as on the tree without it."""
    if tree.port:
        statements = sample_tokens_statements(tree.runner, tree.port)
        names = {"grammar_output": object(), "num_decodes": 2, "self": SimpleNamespace(_get_model_type=lambda: "llama"),
                 "decode_data": SimpleNamespace(spec_decode_metadata=1)}
        run_statements(statements[:2], tree.runner, names)
        assert names["verify_under_grammar"] is False
    with pytest.raises(IndexError):
        run_step(tree, monkeypatch, model_type="llama")
