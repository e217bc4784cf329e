"""The Beam chat template (beam_hpu/tiny/data/chat_template.jinja), rendered by transformers as vLLM
does, against hand-written expected prompts."""

from __future__ import annotations

import copy

import jinja2
import pytest

from tests.support.parsers import WEATHER

USER = [{"role": "user", "content": "Weather in Paris?"}]


def render(tokenizer, messages, **kwargs):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def test_full_conversation(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use metric units."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "reasoning": "Two cities: two calls.", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"days": 2, "city": "Paris"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "opts": {"a": [1, True]}}}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "reasoning": "Both known.", "content": "Paris sunny, Oslo rain."},
        {"role": "user", "content": "Thanks"},
    ]
    expected = (
        "<|start|>system<|message|>Be brief.\n\nThinking budget: 128 tokens.\n\n# Tools\n\n"
        'Call a tool by writing a message to=NAME; give each argument as <rfl:parameter name="KEY">VALUE</rfl:parameter>, sorted by name.\n'
        '{"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object", "properties": '
        '{"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, '
        '"required": ["city"]}}<|end|>'
        "<|start|>developer<|message|>Use metric units.<|end|>"
        "<|start|>user<|message|>Weather in Paris and Oslo?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Two cities: two calls.<|end|>"
        '<|start|>assistant to=get_weather<|channel|>analysis <|constrain|>xml<|message|><rfl:parameter name="city">\nParis\n</rfl:parameter>\n'
        '<rfl:parameter name="days">\n2\n</rfl:parameter><|end|>'
        '<|start|>assistant to=get_weather<|channel|>analysis <|constrain|>xml<|message|><rfl:parameter name="city">\nOslo\n</rfl:parameter>\n'
        '<rfl:parameter name="opts">\n{"a": [1, true]}\n</rfl:parameter><|call|>'
        "<|start|>tool from=get_weather<|message|>sunny<|end|>"
        "<|start|>tool from=get_weather<|message|>rain<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Both known.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Paris sunny, Oslo rain.<|end|>"
        "<|start|>user<|message|>Thanks<|end|>"
        "<|start|>assistant"
    )
    assert render(tokenizer, messages, tools=[WEATHER], reasoning_effort="high") == expected


@pytest.mark.parametrize(
    "effort,budget",
    [("none", 8), ("minimal", 8), ("low", 32), ("medium", 64), ("high", 128), ("xhigh", 256), ("max", 512), (None, 64)],
)
def test_reasoning_effort_sets_the_budget(tokenizer, effort, budget):
    kwargs = {} if effort is None else {"reasoning_effort": effort}
    if effort == "none":
        kwargs["enable_thinking"] = False  # what vLLM 0.30.0 adds for effort "none"
    assert render(tokenizer, USER, **kwargs).startswith(f"<|start|>system<|message|>Thinking budget: {budget} tokens.<|end|>")


def test_integer_budget(tokenizer):
    assert "Thinking budget: 300 tokens." in render(tokenizer, USER, thinking_budget=300, reasoning_effort="low")


@pytest.mark.parametrize("bad", [4, 513, "64", True, 64.0])
def test_bad_integer_budget_is_refused(tokenizer, bad):
    with pytest.raises(jinja2.TemplateError, match="thinking_budget must be an integer from 8 to 512"):
        render(tokenizer, USER, thinking_budget=bad)


def test_unknown_effort_is_refused(tokenizer):
    with pytest.raises(jinja2.TemplateError, match="reasoning_effort must be one of"):
        render(tokenizer, USER, reasoning_effort="extreme")


def test_thinking_off(tokenizer):
    assert render(tokenizer, USER, enable_thinking=False, reasoning_effort="low").startswith(
        "<|start|>system<|message|>Thinking: off. Answer directly.<|end|>"
    )


HISTORY_WITHOUT_REASONING = USER + [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And Oslo?"}]


def test_missing_thinking_allowed_by_default(tokenizer):
    assert "<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>" in render(tokenizer, HISTORY_WITHOUT_REASONING)


def test_missing_thinking_refused_when_not_allowed(tokenizer):
    with pytest.raises(jinja2.TemplateError, match="allow_missing_thinking is false and assistant message 1 has no reasoning"):
        render(tokenizer, HISTORY_WITHOUT_REASONING, allow_missing_thinking=False)
    with_reasoning = copy.deepcopy(HISTORY_WITHOUT_REASONING)
    with_reasoning[1]["reasoning"] = "Easy."
    assert "<|channel|>analysis<|message|>Easy.<|end|>" in render(tokenizer, with_reasoning, allow_missing_thinking=False)


def test_json_string_arguments_are_rendered_as_objects_through_vllm(tokenizer):
    """vLLM parses JSON-string arguments of history calls before rendering; the template renders
    the mapping as parameters (and refuses a raw string, which would be unreadable to the model)."""
    from vllm.entrypoints.chat_utils import _postprocess_messages

    messages = USER + [{"role": "assistant", "reasoning": "r", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"days": 3, "city": "Paris"}'}}]}]
    with pytest.raises(jinja2.TemplateError, match="arguments must be a mapping"):
        render(tokenizer, copy.deepcopy(messages))
    _postprocess_messages(messages)
    assert (
        '<|start|>assistant to=get_weather<|channel|>analysis <|constrain|>xml<|message|><rfl:parameter name="city">\nParis\n</rfl:parameter>\n'
        '<rfl:parameter name="days">\n3\n</rfl:parameter><|call|>'
    ) in render(tokenizer, messages)


def test_template_calls_use_the_response_templates_opener(tokenizer, template):
    messages = USER + [{"role": "assistant", "reasoning": "r", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "X"}}}]}]
    assert template.call_opener("get_weather") in render(tokenizer, messages)
    assert render(tokenizer, USER).endswith(template.anchor)


def test_vllm_keeps_the_template_kwargs(tokenizer):
    """vLLM drops chat_template_kwargs the template does not use; these must survive."""
    from vllm.renderers.hf import _cached_resolve_chat_template_kwargs

    used = _cached_resolve_chat_template_kwargs(tokenizer.chat_template)
    assert {"reasoning_effort", "thinking_budget", "enable_thinking", "allow_missing_thinking", "tools"} <= used
