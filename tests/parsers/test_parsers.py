"""The `beam` reasoning + tool parsers on hand-written outputs, through vLLM's composed parser,
non-streaming and streamed token by token. Every streamed case must concatenate to exactly the
non-streaming result."""

from __future__ import annotations

import json

import pytest

from tests.support.parsers import (ANSWER, CALL_OPEN, ONE_CALL, PARALLEL, THINK, TOOLS, TYPED_CALL, call, chat_request,
                                   param)

from .driver import parse_stream, parse_whole

CALL_THEN_ANSWER = ONE_CALL + "<|end|><|start|>assistant<|channel|>final<|message|>Checking."

EXPECTED = {
    "answer": ("The user wants weather.", "It is sunny in Paris.", []),
    "one_call": ("The user wants weather.", None, [("get_weather", {"city": "Paris", "days": 2})]),
    "typed_call": (
        "The user wants weather.",
        None,
        [("typed", {"a_int": 7, "b_num": 2.5, "c_bool": True, "d_null": None, "e_obj": {"k": [1, "x"]},
                    "f_arr": [1, 2, 3], "g_str": 'say "hi"\nback\\slash'})],
    ),
    "parallel": (
        "The user wants weather.",
        None,
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "unit": "celsius"})],
    ),
    "call_then_answer": ("The user wants weather.", "Checking.", [("get_weather", {"city": "Paris", "days": 2})]),
}
OUTPUTS = {"answer": ANSWER, "one_call": ONE_CALL, "typed_call": TYPED_CALL, "parallel": PARALLEL,
           "call_then_answer": CALL_THEN_ANSWER}


def check(got, expected):
    reasoning, content, calls = expected
    assert got.reasoning == reasoning
    assert got.content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got.calls] == calls


@pytest.mark.parametrize("case", sorted(OUTPUTS))
def test_non_streaming(parser_cls, tokenizer, case):
    got = parse_whole(parser_cls, tokenizer, chat_request(TOOLS), OUTPUTS[case])
    check(got, EXPECTED[case])


@pytest.mark.parametrize("stream_args", ["1", "0"])
@pytest.mark.parametrize("case", sorted(OUTPUTS))
def test_streaming_equals_non_streaming(parser_cls, tokenizer, monkeypatch, case, stream_args):
    monkeypatch.setenv("VLLM_BEAM_STREAM_TOOL_ARGS", stream_args)
    request = chat_request(TOOLS)
    whole = parse_whole(parser_cls, tokenizer, request, OUTPUTS[case])
    streamed = parse_stream(parser_cls, tokenizer, request, OUTPUTS[case])
    check(streamed, EXPECTED[case])
    # Byte for byte, not just the same JSON value.
    assert [c["arguments"] for c in streamed.calls] == [c["arguments"] for c in whole.calls]
    assert "<|" not in (streamed.content or "") and "rfl:" not in (streamed.content or "")


def _call_pieces(deltas, index):
    return [tc for d in deltas for tc in d.tool_calls if tc.index == index]


def test_streamed_arguments_arrive_as_values_do(parser_cls, tokenizer, monkeypatch):
    monkeypatch.setenv("VLLM_BEAM_STREAM_TOOL_ARGS", "1")
    long_city = "San Francisco del Norte y Sur"
    output = THINK + call("get_weather", ("city", long_city))
    got = parse_stream(parser_cls, tokenizer, chat_request(TOOLS), output)
    pieces = _call_pieces(got.deltas, 0)
    assert pieces[0].function.name == "get_weather" and pieces[0].id and not pieces[0].function.arguments
    args = [p.function.arguments for p in pieces[1:] if p.function.arguments]
    assert len(args) > 5, "a string value must stream in pieces, not at the close"
    assert "".join(args) == json.dumps({"city": long_city})


def test_whole_calls_when_streaming_off(parser_cls, tokenizer, monkeypatch):
    monkeypatch.setenv("VLLM_BEAM_STREAM_TOOL_ARGS", "0")
    got = parse_stream(parser_cls, tokenizer, chat_request(TOOLS), PARALLEL)
    for index in (0, 1):
        pieces = _call_pieces(got.deltas, index)
        assert len(pieces) == 1 and pieces[0].function.name == "get_weather" and pieces[0].id
    assert json.loads(_call_pieces(got.deltas, 1)[0].function.arguments) == {"city": "Oslo", "unit": "celsius"}


def test_unicode_value_split_mid_character(parser_cls, tokenizer, monkeypatch):
    monkeypatch.setenv("VLLM_BEAM_STREAM_TOOL_ARGS", "1")
    output = THINK + call("get_weather", ("city", "Zürich — 東京"))
    # Character-sized deltas (a detokenizer holds back partial UTF-8, so it never splits one).
    deltas = [(ch, []) for ch in output]
    got = parse_stream(parser_cls, tokenizer, chat_request(TOOLS), output, deltas=deltas)
    whole = parse_whole(parser_cls, tokenizer, chat_request(TOOLS), output)
    assert got.calls == whole.calls == [{"name": "get_weather", "arguments": '{"city": "Zürich — 東京"}'}]


def test_thinking_off_passes_content_through(parser_cls, tokenizer):
    kwargs = {"enable_thinking": False}
    request = chat_request(TOOLS)
    direct = "<|channel|>final<|message|>Direct answer."
    for parse in (parse_whole, parse_stream):
        got = parse(parser_cls, tokenizer, request, direct, chat_template_kwargs=kwargs)
        assert (got.reasoning, got.content, got.calls) == (None, "Direct answer.", [])
        # A model that reasons anyway: nothing is classified as reasoning.
        got = parse(parser_cls, tokenizer, request, ANSWER, chat_template_kwargs=kwargs)
        assert got.reasoning is None and got.content == "The user wants weather.It is sunny in Paris."


def test_effort_none_still_reasons(parser_cls, tokenizer):
    # vLLM sets enable_thinking=False for reasoning_effort "none"; Beam serves it as minimal.
    kwargs = {"enable_thinking": False, "reasoning_effort": "none"}
    got = parse_whole(parser_cls, tokenizer, chat_request(TOOLS), ANSWER, chat_template_kwargs=kwargs)
    assert got.reasoning == "The user wants weather."


def test_tool_choice_none_drops_calls_and_keeps_content_clean(parser_cls, tokenizer):
    request = chat_request(TOOLS, tool_choice="none")
    for parse in (parse_whole, parse_stream):
        got = parse(parser_cls, tokenizer, request, CALL_THEN_ANSWER)
        assert got.calls == [] and got.content == "Checking."


def test_direct_call_without_reasoning(parser_cls, tokenizer):
    # Thinking off: the first message is a call, written right after the prompt's anchor.
    output = " to=get_weather<|channel|>analysis <|constrain|>xml<|message|>" + param("city", "Rome")
    for parse in (parse_whole, parse_stream):
        got = parse(parser_cls, tokenizer, chat_request(TOOLS), output, chat_template_kwargs={"enable_thinking": False})
        assert got.calls == [{"name": "get_weather", "arguments": '{"city": "Rome"}'}] and not got.content


# -- bad outputs: never crash, keep what is well formed --------------------------------------


BAD = {
    # A channel the template does not define: its message is dropped.
    "unknown_channel": (
        THINK + "<|start|>assistant<|channel|>commentary<|message|>side note<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Answer.",
        ("The user wants weather.", "Answer.", []),
    ),
    # The last call's closer is an EOS token (not in the text); an explicit one is read too.
    "explicit_call_closer": (ONE_CALL + "<|call|>", EXPECTED["one_call"]),
    # Text between messages is dropped.
    "garbage_between_messages": (
        THINK + "junk text \n" + call("get_weather", ("city", "Paris"), ("days", "2")) + "<|end|>more junk",
        EXPECTED["one_call"],
    ),
    # Garbage between parameters is dropped; the parameters are kept.
    "garbage_between_parameters": (
        THINK + CALL_OPEN.format("get_weather") + param("city", "Paris") + " oops " + param("days", "2"),
        EXPECTED["one_call"],
    ),
    # An unclosed reasoning message followed by a new message: closed where the new one starts.
    "unclosed_reasoning": (
        "<|channel|>analysis<|message|>The user wants weather.<|start|>assistant<|channel|>final<|message|>Hi.",
        ("The user wants weather.", "Hi.", []),
    ),
    # A header cut by the end of the output: no call.
    "header_cut": (THINK + "<|start|>assistant to=get_wea", ("The user wants weather.", None, [])),
    # A call to a tool the request does not have: reported (a harness can tell the model), as text.
    "unknown_tool": (
        THINK + call("launch", ("n", "3")),
        ("The user wants weather.", None, [("launch", {"n": "3"})]),
    ),
    # A value that does not fit its type stays the model's text.
    "mistyped_value": (
        THINK + call("get_weather", ("city", "Paris"), ("days", "two")),
        ("The user wants weather.", None, [("get_weather", {"city": "Paris", "days": "two"})]),
    ),
    # A stray control token inside an answer is dropped.
    "stray_control_token": (
        THINK + "<|start|>assistant<|channel|>final<|message|>A<|constrain|>B",
        ("The user wants weather.", "AB", []),
    ),
    # A repeated parameter keeps its first value.
    "repeated_parameter": (
        THINK + call("get_weather", ("city", "Paris"), ("city", "Oslo")),
        ("The user wants weather.", None, [("get_weather", {"city": "Paris"})]),
    ),
    # Reasoning cut by max_tokens: reasoning so far, nothing else.
    "reasoning_cut": ("<|channel|>analysis<|message|>The user wa", ("The user wa", None, [])),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("mode", ["whole", "stream_args", "stream_whole_calls"])
def test_bad_outputs(parser_cls, tokenizer, monkeypatch, case, mode):
    monkeypatch.setenv("VLLM_BEAM_STREAM_TOOL_ARGS", "0" if mode == "stream_whole_calls" else "1")
    output, expected = BAD[case]
    parse = parse_whole if mode == "whole" else parse_stream
    check(parse(parser_cls, tokenizer, chat_request(TOOLS), output), expected)


def test_call_cut_by_max_tokens(parser_cls, tokenizer, monkeypatch):
    """Cut inside a value: non-streaming drops that parameter; a client of the argument stream
    holds exactly the text below, which does not parse (the documented limitation); with whole
    calls the stream equals non-streaming."""
    output = THINK + CALL_OPEN.format("get_weather") + param("days", "2") + "\n" + '<rfl:parameter name="city">\nPar'
    request = chat_request(TOOLS)
    assert parse_whole(parser_cls, tokenizer, request, output).calls == [
        {"name": "get_weather", "arguments": '{"days": 2}'}
    ]
    monkeypatch.setenv("VLLM_BEAM_STREAM_TOOL_ARGS", "1")
    streamed = parse_stream(parser_cls, tokenizer, request, output)
    assert streamed.calls == [{"name": "get_weather", "arguments": '{"days": 2, "city": "Par'}]
    monkeypatch.setenv("VLLM_BEAM_STREAM_TOOL_ARGS", "0")
    assert parse_stream(parser_cls, tokenizer, request, output).calls == [
        {"name": "get_weather", "arguments": '{"days": 2}'}
    ]


def test_cut_inside_a_typed_value_streams_the_same_as_non_streaming(parser_cls, tokenizer, monkeypatch):
    # Non-string values are sent at their close, so a cut inside one has sent nothing of it: the
    # stream closes the call without it, exactly as non-streaming does.
    monkeypatch.setenv("VLLM_BEAM_STREAM_TOOL_ARGS", "1")
    output = THINK + CALL_OPEN.format("get_weather") + param("city", "Paris") + '\n<rfl:parameter name="days">\n1'
    expected = [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert parse_stream(parser_cls, tokenizer, chat_request(TOOLS), output).calls == expected
    assert parse_whole(parser_cls, tokenizer, chat_request(TOOLS), output).calls == expected
