"""The trained tiny EAGLE3 drafter served through `vllm serve` with the committed tiny trained Beam:
lossless at temperature 0 and worth its cost.

One server without speculation, then one with `--speculative-config` naming the drafter (never two
engines at once); the same requests to both: copy completions (token ids), gate chat prompts with
reasoning, tool calls and json_schema answers, each streamed and not. Every answer must be identical
(tokens, reasoning/content split, tool calls and their streamed arguments). The mean accepted length
(1 + accepted drafted tokens per draft, from the server's /metrics spec-decode counters) on the copy
prompts is printed and must show the drafter helps.
"""

import json
import random

import pytest
from openai import OpenAI

from beam_hpu.tiny import tasks as syn
from beam_hpu.tiny.checkpoint import TRAINED_DIR
from beam_hpu.tiny.drafter import SERVED_SPECULATIVE_TOKENS, speculative_config
from tests.support.served_spec import accepted_and_rejected, chat_once, spec_counters
from tests.support.server import Server

pytestmark = pytest.mark.slow

COPY_ACCEPTED_LENGTH_FLOOR = 1.5  # tokens per verify step; 1.0 means no draft was ever accepted


def copy_prompts(n=3, length=96, restart=8, seed=41):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TRAINED_DIR))
    pieces = syn.printable_token_ids(tok)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        passage = [rng.choice(pieces) for _ in range(length)]
        out.append(passage + passage[:restart])
    return out


def chat_requests():
    rng = random.Random(7)
    json_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": syn.CITY_SCHEMA}}
    return [
        {"messages": [{"role": "user", "content": "Repeat after me: Paris"}]},
        {"messages": [{"role": "user", "content": syn.needle_prompt(
            "the river town", syn.random_key(rng), syn.random_code(rng), 0.5)}]},
        {"messages": [{"role": "user", "content": syn.weather_prompt("Rome", 3)}], "tools": syn.TOOLS},
        {"messages": [{"role": "user", "content": syn.parallel_prompt("Oslo", "Lima")}], "tools": syn.TOOLS},
        {"messages": [{"role": "user", "content": syn.json_prompt("Cairo")}], "response_format": json_format},
    ]


def run_all(server) -> dict:
    client = OpenAI(base_url=server.base_url, api_key="none")
    before = spec_counters(server)
    copies = []
    for p in copy_prompts():
        c = client.completions.create(model=server.model, prompt=p, max_tokens=48, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
        copies.append(list(c.token_ids))
    after_copy = spec_counters(server)
    chats = [[chat_once(client, server.model, r, stream) for stream in (False, True)] for r in chat_requests()]
    return {"copies": copies, "chats": chats, "copy_counters": {k: after_copy[k] - before[k] for k in before},
            "all_counters": spec_counters(server)}


@pytest.fixture(scope="module")
def runs(shared_server):
    base = run_all(shared_server(TRAINED_DIR))
    drafted = Server(TRAINED_DIR, extra=["--speculative-config", speculative_config()])
    try:
        spec = run_all(drafted)
        log = drafted.log_text()
    finally:
        drafted.stop()
    return base, spec, log


def test_drafter_was_loaded_and_drafted(runs):
    _, spec, log = runs
    assert "Eagle3LlamaForCausalLM" in log or "LlamaForCausalLMEagle3" in log
    assert spec["all_counters"]["drafts"] > 0


def test_copy_is_token_identical_and_the_drafter_helps(runs):
    base, spec, _ = runs
    assert spec["copies"] == base["copies"]
    c = spec["copy_counters"]
    mean_accepted = 1 + c["accepted"] / c["drafts"]
    print(f"EAGLE3 tiny drafter, k={SERVED_SPECULATIVE_TOKENS}: mean accepted length on copy {mean_accepted:.2f} "
          f"tokens per step ({c['accepted']:.0f} of {c['draft_tokens']:.0f} drafted tokens accepted)")
    assert mean_accepted > COPY_ACCEPTED_LENGTH_FLOOR


def test_chat_answers_identical_streamed_and_not(runs):
    base, spec, _ = runs
    for b, s, req in zip(base["chats"], spec["chats"], chat_requests()):
        assert s == b, req["messages"][-1]["content"][:60]
        assert s[0] == s[1]  # streamed adds up to the non-streamed answer
    # The requests exercise what they should: reasoning, calls (one and two), a JSON answer.
    plain_answers = [pair[0] for pair in base["chats"]]
    assert all(a["reasoning"] for a in plain_answers)
    assert [len(a["calls"]) for a in plain_answers[2:4]] == [1, 2]
    assert json.loads(plain_answers[4]["content"]) == {"city": "Cairo"}
    c = spec["all_counters"]
    print(f"EAGLE3 tiny drafter over every request: mean accepted length {1 + c['accepted'] / c['drafts']:.2f}")
    assert accepted_and_rejected(c["accepted"], c["draft_tokens"]), c
