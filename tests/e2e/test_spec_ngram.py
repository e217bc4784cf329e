"""Prompt-lookup (ngram) and suffix drafts through the whole port are lossless.

Two real `vllm serve` runs of the tiny trained Beam, one after the other (one engine at a time):
the demo's command line, and the same plus `--speculative-config` ngram (k=4, lookup 2..4). The
same requests go to both: the smoke, copy and tools gates (gate prompts, tool calls of every
tool_choice, reasoning, the json_schema answer; streaming and not), a seeded random-sampling
request, and a grammar case built so the ngram draft proposes a continuation the grammar forbids
(the scheduler trims it before verification; the verifier's own check is a unit test, see below).
At temperature 0 every answer must be identical: token ids where the API returns them, else the
reasoning / content / tool-call split and the streamed tool arguments.

Served in float32 on both sides: a verify step runs k+1 query tokens through the model where plain
decode runs one, and in bf16 vLLM-CPU's kernels round such batches differently (argmax flips at
near-ties are fp noise, not a speculation bug); float32 compares like with like.

Suffix decoding: vLLM 0.30.0's `suffix` method needs only arctic-inference's suffix tree (a C++
extension without CUDA code); PyPI has only its 0.3.0 sdist, which `scripts/cpu-env.sh` builds
(CMake must find nanobind). Its vLLM plugin stays off unless ARCTIC_INFERENCE_ENABLED is set.
Its run shares the plain run with ngram's (one server start fewer).

The rejection sampler runs on CPU only through the `cpu-rejection-sampler` patch (without it the
first verify step kills the engine).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import httpx
import numpy as np
import pytest
from transformers import AutoTokenizer

from beam_hpu.gates import copy as copy_gate
from beam_hpu.gates import smoke as smoke_gate
from beam_hpu.gates import tools as tools_gate
from beam_hpu.gates.client import Endpoint, assembled
from beam_hpu.gates.profile import get_profile
from beam_hpu.tiny import tasks as syn
from beam_hpu.tiny.checkpoint import TRAINED_DIR
from tests.support.served_spec import accepted_and_rejected
from tests.support.server import Server

pytestmark = pytest.mark.slow
PROFILE = get_profile("cpu")
SPLIT = ("reasoning", "content", "tool_calls", "finish_reason")  # an answer as the client sees it
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

# The grammar case: an earlier turn answered {"city": "Tokyo"} and the question asks for Tokyo again,
# but the json_schema allows only "Lima". Once the answer reaches `{"city": "`, the longest
# earlier match is the first turn's answer, so the ngram draft proposes `Tokyo"}`, which the
# grammar forbids (the model, unconstrained, would answer Tokyo).
ONLY_LIMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Lima"]}}, "required": ["city"],
             "additionalProperties": False}
GRAMMAR_MESSAGES = [{"role": "user", "content": syn.json_prompt("Tokyo")},
                    syn.assistant_answer("JSON with city Tokyo.", syn.json_answer("Tokyo")),
                    {"role": "user", "content": syn.json_prompt("Tokyo")}]
PATTERN_PROMPT = "x=1;x=2;" * 12 + "x="


@dataclass
class Recording(Endpoint):
    """An Endpoint that keeps every answer it was given, in request order, with token ids
    where the API returns them."""
    answers: list = field(default_factory=list)

    def chat(self, messages, **kw):
        kw["extra_body"] = {**kw.get("extra_body", {}), "return_token_ids": True}
        resp = super().chat(messages, **kw)
        c = resp.choices[0]
        self.answers.append({"kind": "chat", "messages": messages, "token_ids": list(c.token_ids or []),
                             **assembled(resp)})
        return resp

    def chat_stream(self, messages, **kw):
        out = super().chat_stream(messages, **kw)
        self.answers.append({"kind": "chat-stream", "messages": messages, **out})
        return out

    def complete_ids(self, prompt_ids, max_tokens, **extra):
        out = super().complete_ids(prompt_ids, max_tokens, **extra)
        self.answers.append({"kind": "completion", "prompt": prompt_ids, "token_ids": out["token_ids"]})
        return out


def spec_counters(server) -> dict:
    text = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=30).text
    out = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        m = re.search(rf"^vllm:spec_decode_{name}_total{{[^}}]*}} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def grammar_case(ep: Endpoint) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": ONLY_LIMA, "strict": True}}
    r = ep.client.chat.completions.create(model=ep.model, messages=GRAMMAR_MESSAGES, max_tokens=80, temperature=0.0,
                                          response_format=fmt, extra_body={"return_token_ids": True})
    return {**assembled(r), "token_ids": list(r.choices[0].token_ids), "prompt_ids": list(r.prompt_token_ids)}


def seeded_random(ep: Endpoint) -> list[str]:
    """Random sampling through the CPU rejection sampler's random path, seeded twice."""
    return [ep.client.completions.create(model=ep.model, prompt=PATTERN_PROMPT, max_tokens=24, temperature=0.8,
                                         seed=1234).choices[0].text for _ in range(2)]


FLOAT32 = ["--dtype", "float32"]


def answer(server) -> dict:
    ep = Recording(server.base_url, server.model)
    gates = {g.__name__.rsplit(".", 1)[-1]: g.run(ep, PROFILE) for g in (smoke_gate, copy_gate, tools_gate)}
    return {"gates": gates, "answers": ep.answers, "grammar": grammar_case(ep),
            "random": seeded_random(ep), "counters": spec_counters(server)}


def serve_and_answer(extra: list[str]) -> dict:
    server = Server(TRAINED_DIR, extra=[*FLOAT32, *extra])
    try:
        return answer(server)
    finally:
        server.stop()


SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}


def suffix_decoding_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("arctic_inference") is not None


@pytest.fixture(scope="module")
def served(shared_server):
    """One plain run for both methods, on the session's float32 server (each start costs CI a minute)."""
    plain = answer(shared_server(TRAINED_DIR, FLOAT32))
    spec = serve_and_answer(["--speculative-config", json.dumps(NGRAM)])
    suffix = serve_and_answer(["--speculative-config", json.dumps(SUFFIX)]) if suffix_decoding_installed() else None
    return plain, spec, suffix


@pytest.fixture(scope="module")
def runs(served):
    return served[0], served[1]


@pytest.fixture(scope="module")
def suffix_runs(served):
    if served[2] is None:
        pytest.skip("arctic-inference (suffix decoding) is not installed; scripts/cpu-env.sh builds it")
    return served[0], served[2]


def first_difference(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def test_speculation_drafted_and_accepted(runs):
    plain, spec = runs
    c = spec["counters"]
    assert plain["counters"]["num_drafts"] == 0
    assert c["num_drafts"] > 0 and c["num_accepted_tokens"] > 0, c
    print(f"ngram: {c['num_drafts']:.0f} drafts, {c['num_draft_tokens']:.0f} drafted tokens, "
          f"{c['num_accepted_tokens']:.0f} accepted; mean accepted length "
          f"{1 + c['num_accepted_tokens'] / c['num_drafts']:.2f}")


def test_every_answer_is_identical_with_and_without_ngram(runs):
    plain, spec = runs
    c = spec["counters"]
    assert accepted_and_rejected(c["num_accepted_tokens"], c["num_draft_tokens"]), c
    assert len(plain["answers"]) == len(spec["answers"]) >= 19  # smoke 6, copy 2, tools 11
    for a, b in zip(plain["answers"], spec["answers"]):
        assert a.get("messages") == b.get("messages") and a.get("prompt") == b.get("prompt")
        if "token_ids" in a:
            assert a["token_ids"], a
            assert b["token_ids"] == a["token_ids"], (a["kind"], first_difference(a["token_ids"], b["token_ids"]))
        # and the reasoning / content / tool split, tool arguments as streamed
        if a["kind"] != "completion":
            assert {k: b[k] for k in SPLIT} == {k: a[k] for k in SPLIT}


def test_the_gates_pass_the_same_with_ngram(runs):
    plain, spec = runs
    for name, result in plain["gates"].items():
        assert spec["gates"][name].passed == result.passed and spec["gates"][name].result == result.result, name
    assert spec["gates"]["tools"].passed, spec["gates"]["tools"].details


def test_streamed_answers_equal_the_whole_ones_with_ngram(runs):
    """The tools gate asks each tool_choice case twice, whole then streamed: with ngram the
    streamed reasoning / content split and tool arguments equal the whole answer's."""
    _, spec = runs
    answers = spec["answers"]
    pairs = [(a, b) for a, b in zip(answers, answers[1:])
             if a["kind"] == "chat" and b["kind"] == "chat-stream" and a["messages"] == b["messages"]]
    assert len(pairs) >= 4  # auto, required, named, none
    for whole, streamed in pairs:
        assert {k: streamed[k] for k in SPLIT} == {k: whole[k] for k in SPLIT}
    assert sum(bool(w["tool_calls"]) for w, _ in pairs) >= 3


def test_seeded_random_sampling_runs_and_repeats_under_ngram(runs):
    _, spec = runs
    first, second = spec["random"]
    assert first and first == second


def test_drafts_the_grammar_forbids_are_never_emitted(runs):
    """The ngram proposer (vLLM's own function, on the served context) proposes a forbidden
    continuation at some step; the served output still matches the grammar, identical to plain.

    End to end only: vLLM's scheduler trims each draft to its grammar-valid prefix before the
    step, so here the verifier never meets the forbidden draft and this passes even with a
    verifier that ignored the grammar. The verifier itself, given a forbidden draft directly, is
    tests/runtime/speculative/test_grammar_forbidden_draft.py (CPU) and tests/runtime/speculative/test_tree_grammar_verify.py
    (vllm-gaudi's verify step)."""
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as propose

    plain, spec = runs
    g = spec["grammar"]
    assert json.loads(g["content"]) == {"city": "Lima"} and g["finish_reason"] == "stop", g
    assert g["token_ids"] == plain["grammar"]["token_ids"]
    tokenizer = AutoTokenizer.from_pretrained(str(TRAINED_DIR))
    ids = g["prompt_ids"] + g["token_ids"]
    forbidden_steps = 0
    for step in range(1, len(g["token_ids"])):
        context = np.array(ids[:len(g["prompt_ids"]) + step], dtype=np.int32)
        draft = propose(context, NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"], 4096,
                        NGRAM["num_speculative_tokens"]).tolist()
        so_far = tokenizer.decode(g["token_ids"][:step])
        if draft and re.search(r'"city"\s*:\s*"$', so_far) and tokenizer.decode(draft).startswith("Tok"):
            forbidden_steps += 1
    assert forbidden_steps > 0, "the case did not make ngram propose the forbidden Tokyo"


# Suffix decoding (vLLM's `suffix` method over arctic-inference's suffix tree): the same requests,
# the same checks as ngram.

def test_suffix_drafted_and_accepted(suffix_runs):
    c = suffix_runs[1]["counters"]
    assert c["num_drafts"] > 0 and c["num_accepted_tokens"] > 0, c
    print(f"suffix: mean accepted length {1 + c['num_accepted_tokens'] / c['num_drafts']:.2f}")


def test_every_answer_is_identical_with_and_without_suffix(suffix_runs):
    plain, spec = suffix_runs
    c = spec["counters"]
    assert accepted_and_rejected(c["num_accepted_tokens"], c["num_draft_tokens"]), c
    assert len(plain["answers"]) == len(spec["answers"]) >= 19
    for a, b in zip(plain["answers"], spec["answers"]):
        if "token_ids" in a:
            assert b["token_ids"] == a["token_ids"], (a["kind"], first_difference(a["token_ids"], b["token_ids"]))
        if a["kind"] != "completion":
            assert {k: b[k] for k in SPLIT} == {k: a[k] for k in SPLIT}
    assert spec["grammar"]["token_ids"] == plain["grammar"]["token_ids"]
    assert json.loads(spec["grammar"]["content"]) == {"city": "Lima"}
    assert all(spec["gates"][n].result == r.result for n, r in plain["gates"].items())


def test_seeded_random_sampling_runs_under_suffix(suffix_runs):
    """Sampled requests verify through the CPU rejection sampler's random path. Unlike ngram, a
    repeat of a seeded request need not repeat its text: suffix decoding drafts from earlier
    responses too (its global tree), so the second run gets other drafts, which draw the seeded
    uniforms differently (lossless in distribution, not sample for sample)."""
    assert all(text for text in suffix_runs[1]["random"])
