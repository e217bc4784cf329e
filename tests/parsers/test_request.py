"""The request adjustment: markup kept in the text, the grammar installed from the first token,
the always-on switch, and the HTTP 400 for forced tool choices the grammar cannot guarantee."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.support.parsers import TOOLS, chat_request


def adjust(parser_cls, tokenizer, chat_template_kwargs=None, **request_kw):
    request = chat_request(**request_kw)
    parser_cls(tokenizer, request.tools, chat_template_kwargs=chat_template_kwargs or {}).adjust_request(request)
    return request


def test_every_turn_is_constrained_by_default(parser_cls, tokenizer):
    request = adjust(parser_cls, tokenizer)
    assert request.skip_special_tokens is False and request.spaces_between_special_tokens is False
    assert request._grammar_from_parser is True
    tag = json.loads(request.structured_outputs.structural_tag)
    assert tag["type"] == "structural_tag" and '{"type": "token", "token": %d}' % tokenizer.convert_tokens_to_ids("<|channel|>") in json.dumps(tag)
    params = request.to_sampling_params(64, {})
    assert params.structured_outputs.structural_tag and params.skip_special_tokens is False


@pytest.mark.parametrize("kw", [{}, {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "required"},
                                {"response_format": {"type": "json_object"}}])
def test_vllm_accepts_the_grammar_as_xgrammar(parser_cls, tokenizer, kw):
    """vLLM validates a structural tag without a tokenizer (control tokens must be given by id);
    a tag it refuses would fall back to guidance, which cannot read it (seen: HTTP 400)."""
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    validate_xgrammar_grammar(adjust(parser_cls, tokenizer, **kw).to_sampling_params(64, {}))


def test_response_format_moves_into_the_answer(parser_cls, tokenizer):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    request = adjust(parser_cls, tokenizer, response_format=fmt)
    assert request.response_format is None
    assert '"json_schema": {"type": "object"}' in request.structured_outputs.structural_tag


@pytest.mark.parametrize(
    "kw,constrained",
    [
        ({}, False),
        ({"tools": TOOLS}, False),  # auto: free
        ({"tools": TOOLS, "tool_choice": "required"}, True),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "typed"}}}, True),
        ({"tools": TOOLS, "tool_choice": "none"}, True),
        ({"response_format": {"type": "json_object"}}, True),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, True),
    ],
)
def test_always_constrain_off_frees_only_unconstrained_turns(parser_cls, tokenizer, monkeypatch, kw, constrained):
    monkeypatch.setenv("VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUT", "0")
    request = adjust(parser_cls, tokenizer, **kw)
    assert request.skip_special_tokens is False  # the parsers need the markup either way
    assert request._grammar_from_parser is constrained
    assert (request.structured_outputs is not None and request.structured_outputs.structural_tag is not None) is constrained


def test_named_tool_not_in_tools_is_a_400(parser_cls, tokenizer):
    from vllm.exceptions import VLLMValidationError

    named = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(VLLMValidationError, match="does not match any of the specified `tools`"):
        chat_request(tools=TOOLS, tool_choice=named)  # vLLM refuses it first ...
    request = chat_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "typed"}})
    request.tools = request.tools[:1]  # ... and the grammar, which must not run unconstrained, too
    with pytest.raises(VLLMValidationError, match="not among the request's tools"):
        parser_cls(tokenizer, request.tools, chat_template_kwargs={}).adjust_request(request)


def test_forced_choice_with_a_foreign_structural_tag_is_a_400(parser_cls, tokenizer):
    from vllm.exceptions import VLLMValidationError

    own = {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}
    with pytest.raises(VLLMValidationError, match="cannot guarantee the forced tool choice"):
        adjust(parser_cls, tokenizer, tools=TOOLS, tool_choice="required", response_format=own)
    # Not forced: the client's own tag is left in place.
    request = adjust(parser_cls, tokenizer, tools=TOOLS, response_format=own)
    assert not request._grammar_from_parser and request.response_format is not None


def test_the_grammar_applies_from_the_first_generated_token(parser_cls, tokenizer):
    """vLLM 0.30.0 serving.py sends `reasoning_ended=True` to the engine when
    `request._grammar_from_parser` is set; the engine's StructuredOutputManager then constrains
    from token 0. Without it, the engine would ask the `beam` reasoner, which (rightly) says a
    prompt ending with `<|start|>assistant` has not ended reasoning, and the grammar would wait."""
    from vllm.v1.structured_output import StructuredOutputManager

    from beam_hpu.parsers.reasoning import BeamReasoningParser

    request = adjust(parser_cls, tokenizer, tools=TOOLS)
    prompt_ids = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    # The serving.py rule, verbatim in effect: include_reasoning, then _grammar_from_parser.
    reasoning_ended = True if request._grammar_from_parser else None

    def engine_request(ended):
        so = SimpleNamespace(reasoning_ended=ended, reasoner=None, reasoning_parser_kwargs={"chat_template_kwargs": {}})
        return SimpleNamespace(structured_output_request=so, prompt_token_ids=prompt_ids, all_token_ids=list(prompt_ids))

    manager = SimpleNamespace(enable_in_reasoning=False, reasoner_cls=BeamReasoningParser, tokenizer=tokenizer)
    manager._get_reasoner = lambda r: StructuredOutputManager._get_reasoner(manager, r)
    start = StructuredOutputManager._get_constraint_start
    assert start(manager, engine_request(reasoning_ended), ()) == 0  # the bitmask applies at token 0
    assert start(manager, engine_request(None), ()) == 1  # without the hook: not yet
