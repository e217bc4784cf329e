"""Request adjustment: what every Beam chat request needs before it reaches the engine.

1. Control tokens stay in the output text (`skip_special_tokens=False`): the parsers read them.
2. The response grammar (`grammar.py`) replaces the request's own constraint, folding a
   `response_format` / `structured_outputs` answer constraint into the answer message.
3. `request._grammar_from_parser = True`: vLLM 0.30.0's chat server then sends the request with
   `reasoning_ended=True` (entrypoints/openai/chat_completion/serving.py), so the engine's
   StructuredOutputManager applies the grammar from the first generated token instead of waiting
   for the reasoning parser to report the end of reasoning. The grammar itself covers the
   reasoning, so nothing is left unconstrained. (`--structured-outputs-config.enable_in_reasoning`
   would do the same server-wide, for every parser and request; this is per request.)

Unconstrained turns (no forced or forbidden tools, no answer format) get the grammar only when
VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUT is on.
"""

from __future__ import annotations

import json
import logging

from beam_hpu.parsers.arguments import tool_parameter_schemas
from beam_hpu.parsers.grammar import ResponseGrammar
from beam_hpu.parsers.template import ResponseTemplate
from beam_hpu.parsers.validation import check_answer_schema, check_grammar_compiles, check_tool_schemas, check_tools
from beam_hpu.settings import switches

logger = logging.getLogger("vllm.beam_hpu.parsers")


def thinking_enabled(chat_template_kwargs: dict | None) -> bool:
    """Thinking is off only when the request turns it off. vLLM 0.30.0 also sets
    `enable_thinking=False` for `reasoning_effort: none`, which Beam serves as `minimal` (the model
    always reasons; the chat template does the same mapping)."""
    kwargs = chat_template_kwargs or {}
    return not (kwargs.get("enable_thinking") is False and kwargs.get("reasoning_effort") != "none")


def _bad_request(message: str, parameter: str):
    from vllm.exceptions import VLLMValidationError

    return VLLMValidationError(message, parameter=parameter)


def _named_tool(tool_choice) -> str | None:
    function = getattr(tool_choice, "function", None)
    if function is not None:
        return getattr(function, "name", None)
    return getattr(tool_choice, "name", None) if getattr(tool_choice, "type", None) == "function" else None


def _answer_body(request) -> tuple[dict | None, bool]:
    """(the answer's format from the request's own constraint, whether one is set that cannot be
    folded into the answer message)."""
    fmt = getattr(request, "response_format", None)
    if fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.json_schema if fmt.json_schema else None
        check_answer_schema(schema or {}, "response_format.json_schema.schema")
        return {"type": "json_schema", "json_schema": schema or {"type": "object"}}, False
    if fmt is not None and fmt.type == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}, False
    if fmt is not None and fmt.type != "text":
        return None, True  # a structural tag of the client's own
    so = getattr(request, "structured_outputs", None)
    if so is None:
        return None, False
    if so.json is not None:
        schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        check_answer_schema(schema, "structured_outputs.json")
        return {"type": "json_schema", "json_schema": schema}, False
    if so.json_object:
        return {"type": "json_schema", "json_schema": {"type": "object"}}, False
    if so.regex is not None:
        return {"type": "regex", "pattern": so.regex}, False
    if so.choice is not None:
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in so.choice]}, False
    if so.grammar is not None:
        return {"type": "grammar", "grammar": so.grammar}, False
    return None, so.structural_tag is not None


def _answer_where(request) -> str:
    fmt = getattr(request, "response_format", None)
    if fmt is not None and fmt.type == "json_schema":
        return "response_format.json_schema.schema"
    return "response_format" if fmt is not None and fmt.type != "text" else "structured_outputs"


def constrain_request(request, template: ResponseTemplate, vocab: dict[str, int], *, thinking: bool):
    """Adjust `request` in place (and return it). Idempotent: the reasoning and the tool parser
    both call it; the first call wins. Raises VLLMValidationError (HTTP 400) for a forced tool
    choice that the grammar cannot guarantee, and for a tool name or schema that validation.py
    refuses."""
    for name in ("skip_special_tokens", "spaces_between_special_tokens"):
        if hasattr(request, name):
            setattr(request, name, False)
    if getattr(request, "_grammar_from_parser", False):
        return request

    check_tools(getattr(request, "tools", None))  # names: also checked before rendering (untrusted.py)
    check_tool_schemas(getattr(request, "tools", None))
    tools = tool_parameter_schemas(getattr(request, "tools", None))
    tool_choice = getattr(request, "tool_choice", None)
    named = _named_tool(tool_choice)
    forced = named is not None or tool_choice == "required"
    answer_body, foreign = _answer_body(request)

    if forced and not tools:
        raise _bad_request("tool_choice requires tools, and the request has none", "tool_choice")
    if named is not None and named not in tools:
        raise _bad_request(f"tool_choice names {named!r}, which is not among the request's tools", "tool_choice")
    if foreign:
        if forced:
            raise _bad_request(
                "cannot guarantee the forced tool choice together with the request's own structural tag",
                "tool_choice",
            )
        logger.warning("beam: the request brings its own structural tag; the response grammar steps back")
        return request
    if forced and answer_body is not None:
        logger.warning("beam: a forced tool choice leaves no answer; the answer format is ignored")
        answer_body = None

    calls_allowed = bool(tools) and tool_choice != "none"  # None = auto, as vLLM reads it
    free_turn = not forced and not (tools and not calls_allowed) and answer_body is None
    if free_turn and not switches.current("VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUT"):
        return request

    callable_tools = {named: tools[named]} if named else (tools if calls_allowed else {})
    grammar = ResponseGrammar(template, vocab)
    tag = grammar.structural_tag(
        thinking=thinking,
        tools=callable_tools,
        allow_answer=not forced,
        parallel=named is None and getattr(request, "parallel_tool_calls", True) is not False,
        answer_body=answer_body,
    )
    answer = (_answer_where(request), answer_body) if answer_body is not None else None
    check_grammar_compiles(tag, grammar.value, getattr(request, "tools", None), answer)
    from vllm.sampling_params import StructuredOutputsParams

    request.structured_outputs = StructuredOutputsParams(structural_tag=json.dumps(tag))
    if hasattr(request, "response_format"):
        request.response_format = None
    request._grammar_from_parser = True
    return request
