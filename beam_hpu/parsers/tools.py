"""`--tool-call-parser beam`: `to=NAME` messages are tool calls, `<rfl:parameter>`s their arguments.

It reads what the `beam` reasoning parser hands over (clean answer text, then raw messages from
the first tool-call header on; see reasoning.py), or a whole raw output. Calls are typed by each
tool's JSON schema (arguments.py). Streaming: with VLLM_BEAM_STREAM_TOOL_ARGS=1 (the default) a
call's name is sent when its header is read, then argument JSON as values arrive; with it off,
each call is sent whole when it closes. Either way the argument text a client concatenates equals
the non-streaming arguments, except for a call the output ended inside a streamed value (the
client then holds argument text that does not parse; non-streaming drops that parameter).

`supports_required_and_named = False`: vLLM would otherwise parse required/named tool choices as
bare JSON; the response grammar makes them Beam calls, so they are read like any other call.
"""

from __future__ import annotations

import logging

from vllm.entrypoints.chat_utils import make_tool_call_id
from vllm.entrypoints.generate.base.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.tool_parsers.abstract_tool_parser import ToolParser

from beam_hpu.parsers.arguments import CallArguments, tool_parameter_schemas
from beam_hpu.parsers.messages import Event, MessageStream
from beam_hpu.parsers.request import constrain_request, thinking_enabled
from beam_hpu.parsers.template import response_template_of
from beam_hpu.settings import switches

logger = logging.getLogger("vllm.beam_hpu.parsers")


class _Call:
    def __init__(self, index: int, name: str, properties: dict | None):
        self.index, self.name, self.id = index, name, make_tool_call_id()
        self.args = CallArguments((properties or {}).get("properties"))
        self.closed = False


class _Calls:
    """Turns message events into answer text and calls, and into stream deltas."""

    def __init__(self, schemas: dict[str, dict], stream_args: bool):
        self.schemas, self.stream_args = schemas, stream_args
        self.calls: list[_Call] = []
        self.content: list[str] = []

    def apply(self, events: list[Event]) -> DeltaMessage | None:
        content: list[str] = []
        pieces: dict[int, DeltaToolCall] = {}

        def send(call: _Call, arguments: str, header: bool = False) -> None:
            piece = pieces.get(call.index)
            if piece is None:
                piece = pieces[call.index] = DeltaToolCall(index=call.index, function=DeltaFunctionCall())
            if header:
                piece.id, piece.type, piece.function.name = call.id, "function", call.name
            if arguments:
                piece.function.arguments = (piece.function.arguments or "") + arguments

        for e in events:
            call = self.calls[-1] if self.calls and not self.calls[-1].closed else None
            if e.kind == "content":
                content.append(e.text)
            elif e.kind == "call_open":
                if e.name not in self.schemas:
                    logger.warning("beam output: call to %r, which is not among the request's tools", e.name)
                call = _Call(len(self.calls), e.name, self.schemas.get(e.name))
                self.calls.append(call)
                if self.stream_args:
                    send(call, "", header=True)
            elif call is None:
                if e.text.strip():
                    logger.warning("beam output: dropped %s text %r", e.kind, e.text[:80])
            elif e.kind == "param_open":
                piece = call.args.open(e.name)
                if self.stream_args:
                    send(call, piece)
            elif e.kind == "param_text":
                piece = call.args.text_piece(e.text)
                if self.stream_args:
                    send(call, piece)
            elif e.kind == "param_close":
                piece = call.args.close(e.name, e.text)
                if self.stream_args:
                    send(call, piece)
            elif e.kind == "param_cut":
                logger.warning("beam output: call %r ended inside parameter %r; dropped it", call.name, e.name)
                call.args.cut(e.name)
            elif e.kind == "call_close":
                call.closed = True
                tail = call.args.finish()
                if self.stream_args:
                    send(call, tail)
                else:
                    send(call, call.args.json_text(), header=True)
            elif e.text.strip():
                logger.warning("beam output: dropped %s text %r in call %r", e.kind, e.text[:80], call.name)
        self.content += content
        if not content and not pieces:
            return None
        return DeltaMessage(content="".join(content) or None, tool_calls=list(pieces.values()))


class BeamToolParser(ToolParser):
    engine_based_streaming = True
    supports_required_and_named = False

    def __init__(self, tokenizer, tools=None):
        super().__init__(tokenizer, tools)
        self.template = response_template_of(tokenizer)
        self.schemas = tool_parameter_schemas(self.tools)
        self._stream = MessageStream(self.template, prelude_is_content=True)
        self._calls = _Calls(self.schemas, switches.current("VLLM_BEAM_STREAM_TOOL_ARGS"))

    def adjust_request(self, request):
        # Normally the reasoning parser has done this already (then it is a no-op). Without one,
        # thinking is read from the request alone.
        thinking = thinking_enabled({**(getattr(request, "chat_template_kwargs", None) or {}),
                                     "reasoning_effort": getattr(request, "reasoning_effort", None)})
        return constrain_request(request, self.template, self.vocab, thinking=thinking)

    def extract_tool_calls(self, model_output: str, request) -> ExtractedToolCallInformation:
        stream = MessageStream(self.template, prelude_is_content=True)
        calls = _Calls(self.schemas, stream_args=False)
        calls.apply(stream.feed(model_output) + stream.finish())
        tool_calls = [
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.args.json_text())) for c in calls.calls
        ]
        content = "".join(calls.content)
        return ExtractedToolCallInformation(
            tools_called=bool(tool_calls), tool_calls=tool_calls, content=content if content.strip() else None
        )

    def extract_tool_calls_streaming(
        self, previous_text, current_text, delta_text, previous_token_ids, current_token_ids, delta_token_ids, request
    ) -> DeltaMessage | None:
        return self._calls.apply(self._stream.feed(delta_text))

    def finish_streaming(self) -> DeltaMessage | None:
        return self._calls.apply(self._stream.finish())
