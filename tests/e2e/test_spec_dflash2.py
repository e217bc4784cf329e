"""Beam's DFlash2 drafter served through `vllm serve` on vLLM-CPU's V1 runner (runtime patch
cpu-dflash2-proposer): the committed tiny DFlash2 drafter with the committed tiny trained Beam.

One server without speculation, then one with `--speculative-config '{"method": "dflash", ...}'`
(never two engines at once), both in float32 (a verify step's k + 1 rows and a decode step's one
round alike only there). At temperature 0 every answer is identical: copy completions by token id,
chat answers with reasoning, a tool call and a json_schema answer (the beam parsers and the
response grammar on every chat step), streamed and not. The proposer must have drafted, and its
mean accepted length is printed.
"""

import json
import random

import httpx
import pytest
from openai import OpenAI

from beam_hpu.demo.serve import draft_arguments
from beam_hpu.tiny import tasks as syn
from beam_hpu.tiny.checkpoint import TRAINED_DIR
from beam_hpu.tiny.dflash2_drafter import SERVED_DRAFTS, speculative_config
from tests.support.readme_requests import demo_requests
from tests.support.served_spec import chat_once, spec_counters
from tests.support.server import Server

pytestmark = pytest.mark.slow

DRAFTED = SERVED_DRAFTS


def copy_prompts(n=3, length=64, restart=8, seed=41):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TRAINED_DIR))
    pieces = syn.printable_token_ids(tok)
    rng = random.Random(seed)
    return [(lambda p: p + p[:restart])([rng.choice(pieces) for _ in range(length)]) for _ in range(n)]


def chat_requests():
    json_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": syn.CITY_SCHEMA}}
    return [
        {"messages": [{"role": "user", "content": "Repeat after me: Paris"}]},
        {"messages": [{"role": "user", "content": syn.weather_prompt("Rome", 3)}], "tools": syn.TOOLS},
        {"messages": [{"role": "user", "content": syn.json_prompt("Cairo")}], "response_format": json_format},
    ]


def run_all(server) -> dict:
    client = OpenAI(base_url=server.base_url, api_key="none")
    copies = []
    for p in copy_prompts():
        c = client.completions.create(model=server.model, prompt=p, max_tokens=40, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
        copies.append(list(c.token_ids))
    copy_counters = spec_counters(server)
    chats = [[chat_once(client, server.model, r, stream, max_tokens=64) for stream in (False, True)] for r in chat_requests()]
    return {"copies": copies, "chats": chats, "copy_counters": copy_counters, "all_counters": spec_counters(server)}


@pytest.fixture(scope="module")
def runs(shared_server):
    base = run_all(shared_server(TRAINED_DIR, ["--dtype", "float32"]))
    drafted = Server(TRAINED_DIR, extra=["--dtype", "float32", "--speculative-config", speculative_config()])
    try:
        spec = run_all(drafted)
        spec["log"] = drafted.log_text()
    finally:
        drafted.stop()
    return base, spec


def test_copy_is_token_identical_and_dflash2_drafted(runs):
    base, spec = runs
    assert spec["copies"] == base["copies"]
    c = spec["copy_counters"]
    assert "cpu-dflash2-proposer: drafting with Beam's DFlash2 drafter" in spec["log"]
    assert c["drafts"] > 0
    print(f"DFlash2 tiny drafter, k={DRAFTED}: mean accepted length on copy {1 + c['accepted'] / c['drafts']:.2f}")


def test_chat_answers_identical_streamed_and_not(runs):
    base, spec = runs
    for b, s, req in zip(base["chats"], spec["chats"], chat_requests()):
        assert s == b, req["messages"][-1]["content"][:60]
        assert s[0] == s[1]
    plain = [pair[0] for pair in base["chats"]]
    assert plain[0]["reasoning"] and len(plain[1]["calls"]) == 1
    assert json.loads(plain[2]["content"]) == {"city": "Cairo"}
    c = spec["all_counters"]
    print(f"DFlash2 tiny drafter over every request: mean accepted length {1 + c['accepted'] / c['drafts']:.2f}")


def demo_answers(server) -> list[dict]:
    out = []
    for body in demo_requests(server.model):
        r = httpx.post(f"{server.base_url}/chat/completions", json=dict(body, temperature=0), timeout=120).json()
        message = r["choices"][0]["message"]
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
        out.append({"reasoning": message.get("reasoning"), "content": message.get("content"), "calls": calls,
                    "finish": r["choices"][0]["finish_reason"]})
    return out


def test_demo_draft_dflash2_answers_the_readme_requests_as_without_it(shared_server):
    """`beam-hpu demo --draft dflash2`'s own command line (the demo's bf16 server plus its
    `--speculative-config`) against the plain demo: the README's two requests, at temperature 0."""
    plain = demo_answers(shared_server(TRAINED_DIR))
    drafted = Server(TRAINED_DIR, extra=draft_arguments("dflash2"))
    try:
        answers = demo_answers(drafted)
        log = drafted.log_text()
    finally:
        drafted.stop()
    assert "cpu-dflash2-proposer: drafting with Beam's DFlash2 drafter" in log
    assert answers == plain
    assert plain[0]["content"] == "Paris" and [name for name, _ in plain[1]["calls"]] == ["get_weather"]
