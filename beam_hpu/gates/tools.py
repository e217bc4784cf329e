"""Tools: the recipe's 11 cases through the chat API with the official `openai` client.

auto, required, named, none (each non-streaming and streaming), parallel calls, `json_schema`,
`reasoning_effort` none. Every case checks structure, never wording: calls present when the choice
requires them, the named tool used, no call for none, every call's arguments valid against its
tool's JSON schema, the json_schema answer valid against its schema, reasoning present, no
template markup in content, finish reason consistent. Each case raises AssertionError with the
assembled response on failure; `tests/e2e/test_tools.py` runs the same cases one by one.
"""

from __future__ import annotations

import json

import jsonschema

from beam_hpu.tiny import tasks as syn
from beam_hpu.gates.client import assembled
from beam_hpu.gates.common import has_markup, user
from beam_hpu.gates.result import GateResult

TOOLS = [syn.WEATHER_TOOL, syn.SEARCH_TOOL]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in syn.TOOLS}


def _respond(ep, profile, stream: bool, messages, **kw) -> dict:
    kw.setdefault("max_tokens", profile.tools_max_tokens)
    kw.setdefault("temperature", 0.0)
    return ep.chat_stream(messages, **kw) if stream else assembled(ep.chat(messages, **kw))


def _common(r: dict) -> None:
    assert r["reasoning"].strip(), f"no reasoning: {r}"
    assert not has_markup(r["content"]), f"template markup in content: {r}"
    assert not has_markup(r["reasoning"]), f"template markup in reasoning: {r}"


def _valid_calls(r: dict, names: set[str] | None = None, at_least: int = 1, finish=("tool_calls",)) -> list[dict]:
    _common(r)
    calls = r["tool_calls"]
    assert len(calls) >= at_least, f"expected at least {at_least} tool call(s): {r}"
    assert r["finish_reason"] in finish, f"finish {r['finish_reason']!r} with tool calls: {r}"
    parsed = []
    for c in calls:
        assert c["name"] in SCHEMAS, f"unknown tool {c['name']!r}: {r}"
        if names is not None:
            assert c["name"] in names, f"tool {c['name']!r} not in {sorted(names)}: {r}"
        args = json.loads(c["arguments"])
        jsonschema.validate(args, SCHEMAS[c["name"]])
        parsed.append({"name": c["name"], "arguments": args})
    return parsed


def _no_calls(r: dict) -> None:
    _common(r)
    assert not r["tool_calls"], f"tool calls with tool_choice none: {r}"
    assert r["content"].strip(), f"no answer: {r}"
    assert r["finish_reason"] == "stop", f"finish {r['finish_reason']!r}: {r}"


def case_auto(ep, profile, stream):
    r = _respond(ep, profile, stream, user(syn.weather_prompt("Paris", 3)), tools=TOOLS, tool_choice="auto")
    return {"calls": _valid_calls(r, {"get_weather"})}


def case_required(ep, profile, stream):
    r = _respond(ep, profile, stream, user(syn.weather_prompt("Lima", None)), tools=TOOLS, tool_choice="required")
    return {"calls": _valid_calls(r)}


def case_named(ep, profile, stream):
    # A weather question with the search tool named: the named tool must be the one called.
    r = _respond(ep, profile, stream, user(syn.weather_prompt("Oslo", None)), tools=TOOLS,
                 tool_choice={"type": "function", "function": {"name": "search"}})
    # A named tool_choice finishes with "stop" in vLLM 0.30.0, as in OpenAI's API for a forced
    # function; "tool_calls" is only for calls the model chose (auto / required).
    calls = _valid_calls(r, {"search"}, finish=("stop", "tool_calls"))
    return {"calls": calls}


def case_none(ep, profile, stream):
    r = _respond(ep, profile, stream, user(syn.weather_prompt("Rome", None)), tools=TOOLS, tool_choice="none")
    _no_calls(r)
    return {"content": r["content"]}


def case_parallel(ep, profile, stream=False):
    r = _respond(ep, profile, stream, user(syn.parallel_prompt("Paris", "Rome")), tools=TOOLS,
                 tool_choice="auto", parallel_tool_calls=True)
    calls = _valid_calls(r, {"get_weather"}, at_least=2)
    cities = {c["arguments"].get("city") for c in calls}
    assert len(cities) >= 2, f"parallel calls should ask for two cities: {calls}"
    return {"calls": calls}


def case_json_schema(ep, profile, stream=False):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": syn.CITY_SCHEMA, "strict": True}}
    r = _respond(ep, profile, stream, user(syn.json_prompt("Tokyo")), response_format=fmt)
    _common(r)
    assert r["finish_reason"] == "stop", f"finish {r['finish_reason']!r}: {r}"
    answer = json.loads(r["content"])
    jsonschema.validate(answer, syn.CITY_SCHEMA)
    return {"answer": answer}


def case_effort_none(ep, profile, stream=False):
    prompt, _ = syn.echo_task(__import__("random").Random(5)) if profile.filler == "tiny" else (
        "What is the capital of France? One word.", None)
    r = _respond(ep, profile, stream, user(prompt), reasoning_effort="none")
    _common(r)  # served as `minimal`: the model still reasons, briefly
    assert r["content"].strip() and r["finish_reason"] == "stop", f"no answer: {r}"
    return {"content": r["content"], "reasoning": r["reasoning"]}


CASES = [
    ("auto", case_auto, False), ("auto-stream", case_auto, True),
    ("required", case_required, False), ("required-stream", case_required, True),
    ("named", case_named, False), ("named-stream", case_named, True),
    ("none", case_none, False), ("none-stream", case_none, True),
    ("parallel", case_parallel, False), ("json_schema", case_json_schema, False),
    ("reasoning_effort-none", case_effort_none, False),
]


def run(ep, profile, **_) -> GateResult:
    rows = {}
    for name, fn, stream in CASES:
        try:
            rows[name] = {"ok": True, **fn(ep, profile, stream)}
        except Exception as e:  # noqa: BLE001 - a failed case is a gate result
            rows[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    ok = sum(r["ok"] for r in rows.values())
    failed = [n for n, r in rows.items() if not r["ok"]]
    return GateResult("tools", ok == len(CASES),
                      "auto, required, named, none (each streaming and not), parallel calls, `json_schema`, "
                      f"`reasoning_effort` none: {ok}/{len(CASES)}" + (f" (failed: {', '.join(failed)})" if failed else ""),
                      {"cases": rows})
