"""`--reasoning-parser beam`: the analysis channel is reasoning, the final channel is content.

How it fits vLLM 0.30.0's DelegatingParser (parser/abstract_parser.py), which runs a reasoning
phase, then hands the rest of the stream to the tool parser once the reasoning parser reports the
end of reasoning. Beam's answer and its tool calls are separate messages after the reasoning, so:
- this parser reads reasoning *and* answer messages (its content is clean answer text), and
  reports the end of reasoning only when a tool-call message begins; it then hands over the unread
  output from that call's header (`finish_streaming`) to the `beam` tool parser, which reads calls
  and any later answer text;
- both parsers are "engine based" (`engine_based_streaming = True`): they keep their own stream
  state, and DelegatingParser routes `tool_choice: none` and the end of the stream through them
  instead of passing raw markup through as content.
Thinking turned off by the request: reasoning text is passed through as content.

The EngineCore structured-output manager also builds this class (`tokenizer=`,
`chat_template_kwargs=`); with the grammar installed it never needs to ask it anything, because the
request arrives with `reasoning_ended=True` (see request.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.reasoning.abs_reasoning_parsers import ReasoningParser

from beam_hpu.parsers.messages import Event, MessageStream
from beam_hpu.parsers.request import constrain_request, thinking_enabled
from beam_hpu.parsers.template import response_template_of

logger = logging.getLogger("vllm.beam_hpu.parsers")


def split_events(events: list[Event], thinking: bool) -> tuple[str, str]:
    """(reasoning text, answer text) of reasoning/content events; the rest is logged and dropped."""
    reasoning, content = [], []
    for e in events:
        if e.kind == "reasoning":
            (reasoning if thinking else content).append(e.text)
        elif e.kind == "content":
            content.append(e.text)
        elif e.kind in ("stray", "unknown") and e.text.strip():
            logger.warning("beam output: dropped %s text %r", e.kind, e.text[:80])
    return "".join(reasoning), "".join(content)


class BeamReasoningParser(ReasoningParser):
    engine_based_streaming = True

    def __init__(self, tokenizer, *args, **kwargs):
        super().__init__(tokenizer, *args, **kwargs)
        self.template = response_template_of(tokenizer)  # refuses a checkpoint without one
        self.thinking = thinking_enabled(kwargs.get("chat_template_kwargs"))
        self._stream = MessageStream(self.template, pause_at_call=True)
        self._ended = False
        self._hand_over = ""
        ids = tokenizer.get_vocab()
        self._control_ids = {ids[c]: c for c in self.template.control_tokens if c in ids}

    # -- what vLLM asks of every reasoning parser

    @property
    def reasoning_start_str(self) -> str:
        return self.template.thinking_openers[0]

    @property
    def reasoning_end_str(self) -> str:
        return self.template.thinking_closers[0]

    def adjust_request(self, request):
        return constrain_request(request, self.template, self.vocab, thinking=self.thinking)

    def extract_reasoning(self, model_output: str, request) -> tuple[str | None, str | None]:
        stream = MessageStream(self.template, pause_at_call=True)
        events = stream.feed(model_output)
        rest = stream.hand_off() if stream.state == stream.PAUSED else ""
        if not rest:
            events += stream.finish()
        reasoning, content = split_events(events, self.thinking)
        content += rest  # from the first tool call on: the tool parser's to read
        return reasoning or None, content or None

    def extract_reasoning_streaming(
        self, previous_text, current_text, delta_text, previous_token_ids, current_token_ids, delta_token_ids
    ) -> DeltaMessage | None:
        if self._ended:
            return None
        events = self._stream.feed(delta_text)
        if self._stream.state == self._stream.PAUSED:
            self._ended = True
            self._hand_over = self._stream.hand_off()
        return _delta(*split_events(events, self.thinking))

    def has_engine_confirmed_reasoning_end(self) -> bool:
        return self._ended

    def finish_streaming(self) -> DeltaMessage | None:
        """At the hand-over: the unread output (DelegatingParser gives it to the tool parser). At
        the end of a stream that never reached a tool call: whatever was held back."""
        if self._hand_over:
            rest, self._hand_over = self._hand_over, ""
            return DeltaMessage(content=rest)
        if self._ended:
            return None
        return _delta(*split_events(self._stream.finish(), self.thinking))

    # -- token-level questions (prompt checks, the engine's reasoning gate, usage counts)

    def _kind(self, ids: Sequence[int], i: int) -> str | None:
        return self._control_ids.get(ids[i])

    def _header(self, ids: Sequence[int], start: int) -> tuple[str, bool]:
        """The header text from `start` up to and with its end token, and whether it is complete."""
        end = start
        while end < len(ids) and self._kind(ids, end) != self.template.header_end:
            end += 1
        return self.model_tokenizer.decode(list(ids[start : end + 1])), end < len(ids)

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether the current assistant turn is past its reasoning: a message of the turn has
        closed, or its open message is not a thinking message. False for a prompt ending with the
        generation anchor, and for a turn that is not the assistant's. Works on the prompt, on
        prompt + output, and on the output alone (its first message follows the prompt's anchor)."""
        ids, closers = input_ids, self.template.closers()
        role = self.template.anchor_role
        starts = [i for i in range(len(ids)) if self._kind(ids, i) == self.template.anchor_token]
        begin = 0
        if starts:
            s = starts[-1]
            if not self.model_tokenizer.decode(list(ids[s + 1 : s + 8])).startswith(role):
                return False
            if len(starts) > 1 and self._kind(ids, s - 1) in closers:
                before = self.model_tokenizer.decode(list(ids[starts[-2] + 1 : starts[-2] + 8]))
                if before.startswith(role):
                    return True  # an earlier message of this assistant turn has closed
            begin = s + 1
        if any(self._kind(ids, i) in closers for i in range(begin, len(ids))):
            return True
        header, complete = self._header(ids, begin)
        if not complete:
            return False
        header = header[len(role) :] if header.startswith(role) and starts else header
        return self.template.classify_header(header)[0] != "thinking"

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        closers = self.template.thinking_closers
        for i, tid in enumerate(input_ids):
            if self._control_ids.get(tid) in closers:
                return list(input_ids[i + 1 :])
        return []

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens in the body of the output's thinking message."""
        if not self.thinking:
            return 0
        message = next((i for i, t in enumerate(token_ids) if self._control_ids.get(t) == self.template.header_end), None)
        if message is None:
            return 0
        kind, _ = self.template.classify_header(self.model_tokenizer.decode(list(token_ids[: message + 1])))
        if kind != "thinking":
            return 0
        end = next((i for i in range(message + 1, len(token_ids)) if self._control_ids.get(token_ids[i])), len(token_ids))
        return end - message - 1


def _delta(reasoning: str, content: str) -> DeltaMessage | None:
    if not reasoning and not content:
        return None
    return DeltaMessage(reasoning=reasoning or None, content=content or None)
