"""A draft the grammar forbids, handed straight to the verifier, is never emitted.

In a served run vLLM's scheduler trims every draft to its grammar-valid prefix
(StructuredOutputManager.validate_tokens) before the step, so the verifier never meets a
forbidden draft there and `tests/e2e/test_spec_ngram.py` would pass with a verifier that ignored
the grammar. Here the scheduler's trim is bypassed: the drafts go as they are into the two calls
vLLM-CPU's runner makes on a verify step (GPUModelRunner.sample_tokens, which CPUModelRunner
inherits): vLLM's own `apply_grammar_bitmask` over all k+1 rows of each request, then vLLM's
`RejectionSampler` through the `cpu-rejection-sampler` patch (beam_hpu/runtime/speculative/rejection_sampling.py).
The grammar is real: a json_schema compiled by vLLM's StructuredOutputManager with xgrammar for the
tiny Beam tokenizer, its k+1 bitmask rows filled by the manager's own `grammar_bitmask`. Only the
input batch is a plain holder of the batch order (`apply_grammar_bitmask` reads its `req_ids` alone).

The target logits put almost all mass on each draft token (the model, unconstrained, would say
Tokyo), so the control, the same verify call without the mask, emits every forbidden draft.

Two served configurations, each with its own manager and draft count K (the bitmask has 1 + K rows
per grammar request): ngram with K = 4, and the DFlash2 one `test_spec_dflash2.py` serves (method
"dflash", the committed tiny DFlash2 drafter, K = SERVED_DRAFTS = 7). The manager reads only the
configuration: building the dflash SpeculativeConfig parses the drafter's config.json (its
architecture resolves once the plugin's model names are registered) and loads no weights.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("xgrammar")

from beam_hpu.tiny.checkpoint import TRAINED_DIR  # noqa: E402
from beam_hpu.tiny.dflash2_drafter import DFLASH2_DIR, SERVED_DRAFTS  # noqa: E402
from tests.support.spec_decode import sampling_metadata, spec_metadata  # noqa: E402

ONLY_LIMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Lima"]}}, "required": ["city"],
             "additionalProperties": False}
SURE = 40.0  # a draft token's logit over noise in [0, 1): its softmax probability is 1 in float32


SPECULATION = {  # method -> the served configuration's own options, K among them
    "ngram": dict(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2),
    "dflash": dict(num_speculative_tokens=SERVED_DRAFTS, model=str(DFLASH2_DIR)),
}


@pytest.fixture(scope="module", params=sorted(SPECULATION))
def manager(request):
    import beam_hpu
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.structured_output import StructuredOutputManager

    # The drafter's architecture (DFlash2BeamDraftModel) must resolve in vLLM's registry; this
    # registers the plugin's model names only, not the runtime patches `register()` installs.
    beam_hpu._register_model()
    model = ModelConfig(model=str(TRAINED_DIR), dtype="float32", max_model_len=256)
    spec = SpeculativeConfig(method=request.param, **SPECULATION[request.param], target_model_config=model,
                             target_parallel_config=ParallelConfig())
    config = VllmConfig(model_config=model, speculative_config=spec)
    assert config.speculative_config.method == request.param  # vLLM would rename a method it does not know
    if request.param == "dflash":  # the configuration the runtime patch gives Beam's DFlash2 proposer
        from beam_hpu.scope import serves_beam_dflash2

        assert serves_beam_dflash2(config)
    return StructuredOutputManager(config)


def json_request(manager, request_id: str, temperature: float, accepted: list[int]):
    """A request under ONLY_LIMA whose grammar has accepted `accepted` (the answer so far)."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.request import Request

    params = SamplingParams(temperature=temperature, seed=7 if temperature else None, max_tokens=32,
                            structured_outputs=StructuredOutputsParams(json=ONLY_LIMA))
    params.structured_outputs._backend = "xgrammar"  # what the frontend's validation sets
    request = Request(request_id, [1, 2, 3], params, None)
    manager.grammar_init(request)
    deadline = time.monotonic() + 120
    while not request.structured_output_request.is_grammar_ready:
        assert time.monotonic() < deadline, "xgrammar did not compile the json_schema in 120 s"
        time.sleep(0.01)
    assert request.structured_output_request.grammar.accept_tokens(request_id, accepted)
    return request


def allowed_next(grammar, vocab: int) -> set[int]:
    """The tokens the grammar accepts next, asked token by token (independent of the bitmask)."""
    return {t for t in range(vocab) if grammar.validate_tokens([t]) == [t]}


@pytest.fixture(scope="module")
def step(manager):
    """One verify step of three grammar requests with K drafts each, batch order differing from the
    scheduler's:
    - "tokyo" (greedy) at `{"city": "` drafts `Tokyo", ...` (its first draft token is forbidden);
    - "limo" (sampled, seeded) at `{"city": "Li` drafts `m a o ...` (its third is forbidden);
    - "lima" (greedy) drafts the K tokens of `{"city": "Lima"}` that end at `Lima` (all allowed:
      accepted, then a bonus token); with K = 4 from `{"city": "`, with K = 7 from `{"`."""
    from transformers import AutoTokenizer
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput

    from beam_hpu.runtime.speculative import patch_cpu_rejection_sampler as cpu_rejection_sampler

    K = manager.vllm_config.num_speculative_tokens
    tok = AutoTokenizer.from_pretrained(str(TRAINED_DIR))
    ids = {piece: tok.convert_tokens_to_ids(piece) for piece in ("T", "ok", "y", "o", "L", "i", "m", "a", "}")}
    assert all(isinstance(i, int) and i >= 0 for i in ids.values()), ids
    opening = tok.encode('{"city": "')
    # Drafts are slices of whole answers, so every draft token is one the tokenizer makes there;
    # what follows a forbidden draft only has to be K tokens long.
    lima = tok.encode('{"city": "Lima"}')
    lima_end = lima.index(ids["a"]) + 1
    assert lima_end >= K, f"`Lima` ends at token {lima_end}: too short for {K} drafts"
    drafts = {"tokyo": tok.encode('{"city": "Tokyo", "city": "Tokyo"}')[len(opening):][:K],
              "limo": tok.encode('{"city": "Limao", "city": "Lima"}')[len(opening) + 2:][:K],
              "lima": lima[lima_end - K:lima_end]}
    assert [len(d) for d in drafts.values()] == [K] * 3
    assert drafts["tokyo"][0] == ids["T"] and drafts["limo"][:3] == [ids["m"], ids["a"], ids["o"]]
    requests = {"tokyo": json_request(manager, "tokyo", 0.0, opening),
                "limo": json_request(manager, "limo", 1.0, opening + [ids["L"], ids["i"]]),
                "lima": json_request(manager, "lima", 0.0, lima[:lima_end - K])}
    # What the scheduler would have let through (it trims before the step; bypassed here)
    trimmed = {r: manager.validate_tokens(requests[r], list(d)) for r, d in drafts.items()}
    assert trimmed == {"tokyo": [], "limo": drafts["limo"][:2], "lima": drafts["lima"]}

    grammar_order, batch_order = ["tokyo", "limo", "lima"], ["lima", "tokyo", "limo"]
    bitmask = manager.grammar_bitmask(requests, grammar_order, drafts)
    assert bitmask.shape[0] == len(grammar_order) * (K + 1)
    vocab = manager.vllm_config.model_config.get_vocab_size()

    # The target: each draft row all but certain of its draft; the bonus rows plain noise
    noise = torch.rand(len(batch_order) * (K + 1), vocab, generator=torch.Generator().manual_seed(3))
    logits = noise.clone()
    for b, r in enumerate(batch_order):
        for i, d in enumerate(drafts[r]):
            logits[b * (K + 1) + i, d] += SURE
    scheduler_output = SchedulerOutput.make_empty()
    scheduler_output.scheduled_spec_decode_tokens = drafts
    grammar_output = GrammarOutput(structured_output_request_ids=grammar_order, grammar_bitmask=bitmask)

    cpu_rejection_sampler.install()
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.structured_output.utils import apply_grammar_bitmask

    verifier = RejectionSampler(Sampler())
    meta = spec_metadata([drafts[r] for r in batch_order])
    temperature = [requests[r].sampling_params.temperature for r in batch_order]

    def verify(masked: bool) -> dict[str, list[int]]:
        step_logits = logits.clone()
        if masked:
            apply_grammar_bitmask(scheduler_output, grammar_output, SimpleNamespace(req_ids=batch_order), step_logits)
        generators = {batch_order.index("limo"): torch.Generator().manual_seed(11)}
        out = verifier(meta, None, step_logits, sampling_metadata(temperature, vocab, generators))
        return {r: [t for t in out.sampled_token_ids[b].tolist() if t >= 0] for b, r in enumerate(batch_order)}

    return SimpleNamespace(verify=verify, drafts=drafts, requests=requests, noise=noise, batch=batch_order,
                           vocab=vocab, opening=opening, ids=ids, k=K)


def test_the_control_without_the_mask_emits_every_forbidden_draft(step):
    """Shows the test below can fail: a verifier that saw unmasked logits emits Tokyo."""
    out = step.verify(masked=False)
    assert out["tokyo"][:step.k] == step.drafts["tokyo"]
    assert out["limo"][:step.k] == step.drafts["limo"]
    assert out["lima"][:step.k] == step.drafts["lima"]


def test_a_forbidden_draft_given_to_the_verifier_is_never_emitted(step):
    out = step.verify(masked=True)
    ids = step.ids
    for r in ("tokyo", "limo", "lima"):
        grammar = step.requests[r].structured_output_request.grammar
        # every emitted sequence is one the grammar accepts from the request's state
        assert grammar.validate_tokens(out[r]) == out[r], (r, out[r])
    # greedy "tokyo": its first draft T is rejected; the emitted token is the masked target's argmax
    (first,) = out["tokyo"]
    allowed = allowed_next(step.requests["tokyo"].structured_output_request.grammar, step.vocab)
    assert ids["T"] not in allowed and first in allowed
    row = step.noise[step.batch.index("tokyo") * (step.k + 1)]
    assert first == max(allowed, key=lambda t: float(row[t]))
    # sampled "limo": m and a accepted, the forbidden o rejected, the recovered token allowed
    assert out["limo"][:2] == [ids["m"], ids["a"]] and len(out["limo"]) == 3
    assert out["limo"][2] != ids["o"]
    # greedy "lima": every allowed draft accepted, then a bonus token the grammar allows after Lima
    assert out["lima"][:step.k] == step.drafts["lima"] and len(out["lima"]) == step.k + 1
