"""The response grammar on xgrammar's real GrammarMatcher with the tiny Beam tokenizer: token by
token, well-formed turns are accepted up to the stop token and malformed ones rejected."""

from __future__ import annotations

import json

import pytest

from tests.support.parsers import (ANSWER, CALL_OPEN, ONE_CALL, PARALLEL, THINK, TOOLS, TYPED_CALL, WEATHER, call,
                                   chat_request, param)

FINAL = "<|start|>assistant<|channel|>final<|message|>"


@pytest.fixture(scope="module")
def compiler(tokenizer):
    import xgrammar as xgr

    vocab = len(tokenizer)
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))


def grammar_for(parser_cls, tokenizer, chat_template_kwargs=None, **request_kw):
    """The structural tag the parser installs on a request (as vLLM would send it)."""
    request = chat_request(**request_kw)
    parser = parser_cls(tokenizer, request.tools, chat_template_kwargs=chat_template_kwargs or {})
    parser.adjust_request(request)
    assert request._grammar_from_parser
    return request.structured_outputs.structural_tag


def accepts(compiler, tokenizer, tag: str, output: str, stop: str) -> bool:
    """Whether the grammar takes `output` token by token and then the stop token (EOS)."""
    import xgrammar as xgr

    stops = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>", "<|endoftext|>"])
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(tag), override_stop_tokens=stops)
    ids = tokenizer.encode(output, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(stop)]
    return all(matcher.accept_token(i) for i in ids) and matcher.is_terminated()


AUTO_OK = [(ANSWER, "<|return|>"), (ONE_CALL, "<|call|>"), (TYPED_CALL, "<|call|>"), (PARALLEL, "<|call|>")]
ALWAYS_BAD = {
    "no reasoning": (FINAL[len("<|start|>assistant"):] + "Hi", "<|return|>"),
    "empty reasoning": ("<|channel|>analysis<|message|><|end|>" + FINAL + "Hi", "<|return|>"),
    "control token in reasoning": ("<|channel|>analysis<|message|>a<|constrain|>b<|end|>" + FINAL + "Hi", "<|return|>"),
    "nothing after reasoning": (THINK, "<|return|>"),
    "unknown channel": (THINK + "<|start|>assistant<|channel|>commentary<|message|>x", "<|return|>"),
    "integer not an integer": (THINK + call("get_weather", ("city", "Paris"), ("days", "two")), "<|call|>"),
    "enum value not in enum": (THINK + call("get_weather", ("city", "Paris"), ("unit", "kelvin")), "<|call|>"),
    "required parameter missing": (THINK + call("get_weather", ("days", "2")), "<|call|>"),
    "arguments not sorted by name": (THINK + call("get_weather", ("days", "2"), ("city", "Paris")), "<|call|>"),
    "unknown parameter": (THINK + call("get_weather", ("city", "Paris"), ("zone", "x")), "<|call|>"),
    "unknown tool": (THINK + call("launch", ("n", "1")), "<|call|>"),
    "value not framed by newlines": (THINK + CALL_OPEN.format("get_weather") + '<rfl:parameter name="city">Paris</rfl:parameter>', "<|call|>"),
    "answer after a call": (ONE_CALL + "<|end|>" + FINAL + "x", "<|return|>"),
    "call not closed before the next": (ONE_CALL + call("get_weather", ("city", "Oslo")), "<|call|>"),
    "call with no arguments although one is required": (THINK + call("get_weather"), "<|call|>"),
    "parameter markup in the answer": (THINK + FINAL + param("city", "Rome"), "<|return|>"),
    "parameter closer in the answer": (THINK + FINAL + "Rome</rfl:parameter>", "<|return|>"),
    "parameter markup in the reasoning": ("<|channel|>analysis<|message|>" + param("city", "Rome") + "<|end|>" + FINAL + "x",
                                          "<|return|>"),
}


@pytest.mark.parametrize("output,stop", AUTO_OK)
def test_auto_accepts_answers_and_calls(parser_cls, tokenizer, compiler, output, stop):
    tag = grammar_for(parser_cls, tokenizer, tools=TOOLS)
    assert accepts(compiler, tokenizer, tag, output, stop)


@pytest.mark.parametrize("case", sorted(ALWAYS_BAD))
def test_auto_rejects_malformed(parser_cls, tokenizer, compiler, case):
    tag = grammar_for(parser_cls, tokenizer, tools=TOOLS)
    assert not accepts(compiler, tokenizer, tag, *ALWAYS_BAD[case])


def test_optional_parameters_may_be_left_out(parser_cls, tokenizer, compiler):
    tag = grammar_for(parser_cls, tokenizer, tools=TOOLS)
    assert accepts(compiler, tokenizer, tag, THINK + call("get_weather", ("city", "Paris")), "<|call|>")
    assert accepts(compiler, tokenizer, tag, THINK + call("typed", ("a_int", "-3")), "<|call|>")


def test_required_forbids_an_answer(parser_cls, tokenizer, compiler):
    tag = grammar_for(parser_cls, tokenizer, tools=TOOLS, tool_choice="required")
    assert accepts(compiler, tokenizer, tag, ONE_CALL, "<|call|>")
    assert accepts(compiler, tokenizer, tag, PARALLEL, "<|call|>")
    assert not accepts(compiler, tokenizer, tag, ANSWER, "<|return|>")


def test_named_allows_only_that_tool_once(parser_cls, tokenizer, compiler):
    named = {"type": "function", "function": {"name": "get_weather"}}
    tag = grammar_for(parser_cls, tokenizer, tools=TOOLS, tool_choice=named)
    assert accepts(compiler, tokenizer, tag, ONE_CALL, "<|call|>")
    assert not accepts(compiler, tokenizer, tag, TYPED_CALL, "<|call|>")
    assert not accepts(compiler, tokenizer, tag, PARALLEL, "<|call|>")
    assert not accepts(compiler, tokenizer, tag, ANSWER, "<|return|>")


def test_none_forbids_calls(parser_cls, tokenizer, compiler):
    tag = grammar_for(parser_cls, tokenizer, tools=TOOLS, tool_choice="none")
    assert accepts(compiler, tokenizer, tag, ANSWER, "<|return|>")
    assert not accepts(compiler, tokenizer, tag, ONE_CALL, "<|call|>")
    # Seen on the tiny trained model: with calls forbidden it wrote the call's parameter into the
    # answer. The answer's text excludes that markup, so the client cannot receive it as content.
    assert not accepts(compiler, tokenizer, tag, THINK + FINAL + param("city", "Rome"), "<|return|>")
    assert accepts(compiler, tokenizer, tag, THINK + FINAL + "rfl: parameter <b>Rome</b>", "<|return|>")


def test_parallel_tool_calls_false_allows_one_call(parser_cls, tokenizer, compiler):
    tag = grammar_for(parser_cls, tokenizer, tools=TOOLS, parallel_tool_calls=False)
    assert accepts(compiler, tokenizer, tag, ONE_CALL, "<|call|>")
    assert not accepts(compiler, tokenizer, tag, PARALLEL, "<|call|>")


def test_no_tools_allows_only_an_answer(parser_cls, tokenizer, compiler):
    tag = grammar_for(parser_cls, tokenizer)
    assert accepts(compiler, tokenizer, tag, ANSWER, "<|return|>")
    assert not accepts(compiler, tokenizer, tag, ONE_CALL, "<|call|>")


def test_json_schema_constrains_the_answer(parser_cls, tokenizer, compiler):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}}
    tag = grammar_for(parser_cls, tokenizer, tools=TOOLS, response_format=fmt)
    assert accepts(compiler, tokenizer, tag, THINK + FINAL + '{"ok": true}', "<|return|>")
    assert not accepts(compiler, tokenizer, tag, THINK + FINAL + '{"ok": "yes"}', "<|return|>")
    assert not accepts(compiler, tokenizer, tag, ANSWER, "<|return|>")
    assert accepts(compiler, tokenizer, tag, ONE_CALL, "<|call|>")  # auto tools stay callable


def test_thinking_off_starts_with_the_answer_or_a_call(parser_cls, tokenizer, compiler):
    tag = grammar_for(parser_cls, tokenizer, chat_template_kwargs={"enable_thinking": False}, tools=TOOLS)
    assert accepts(compiler, tokenizer, tag, "<|channel|>final<|message|>Hi", "<|return|>")
    direct_call = " to=get_weather<|channel|>analysis <|constrain|>xml<|message|>" + param("city", "Rome")
    assert accepts(compiler, tokenizer, tag, direct_call, "<|call|>")
    assert not accepts(compiler, tokenizer, tag, ANSWER, "<|return|>")


def test_effort_none_requires_reasoning(parser_cls, tokenizer, compiler):
    kwargs = {"enable_thinking": False, "reasoning_effort": "none"}
    tag = grammar_for(parser_cls, tokenizer, chat_template_kwargs=kwargs, tools=TOOLS)
    assert accepts(compiler, tokenizer, tag, ANSWER, "<|return|>")
    assert not accepts(compiler, tokenizer, tag, "<|channel|>final<|message|>Hi", "<|return|>")


def test_the_chat_templates_calls_are_what_the_grammar_accepts(parser_cls, tokenizer, compiler):
    """The chat template (jinja) and the grammar (from response_template.json) agree on the wire."""
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "reasoning": "The user wants weather.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"days": 2, "city": "Paris"}}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"unit": "celsius", "city": "Oslo"}}},
        ]},
    ]
    rendered = tokenizer.apply_chat_template(history, tokenize=False)
    turn = rendered[rendered.index("<|start|>assistant") + len("<|start|>assistant"):]
    assert turn.endswith("<|call|>")
    tag = grammar_for(parser_cls, tokenizer, tools=TOOLS)
    assert accepts(compiler, tokenizer, tag, turn[: -len("<|call|>")], "<|call|>")
    assert json.loads(tag)["type"] == "structural_tag"
    assert WEATHER["function"]["name"] in tag


def test_control_tokens_must_be_the_special_tokens(parser_cls, tokenizer, compiler):
    """Seen with a random-weight model through vLLM: `<|message|>` spelled as `<|`, `messa`, ...
    The grammar takes only the special token."""
    import xgrammar as xgr

    tag = grammar_for(parser_cls, tokenizer, tools=TOOLS)
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(tag))
    spelled = tokenizer.encode("<|channel|>analysis", add_special_tokens=False) + tokenizer.encode(
        "<|message", add_special_tokens=False
    )
    assert tokenizer.convert_tokens_to_ids("<|message|>") not in spelled
    assert not all(matcher.accept_token(i) for i in spelled)
