"""Run a model output through the composed parser exactly as vLLM 0.30.0's chat server does
(`chat_completion_full_generator` -> `Parser.parse`; `chat_completion_stream_generator` ->
`Parser.parse_delta` per delta), and collect what a client receives."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Received:
    reasoning: str | None = None
    content: str | None = None
    calls: list[dict] = field(default_factory=list)  # {"name", "arguments", "id"} per call index
    deltas: list = field(default_factory=list)  # the DeltaMessages of a stream


def parse_whole(parser_cls, tokenizer, request, output: str, chat_template_kwargs=None) -> Received:
    parser = parser_cls(tokenizer, request.tools, chat_template_kwargs=chat_template_kwargs or {})
    reasoning, content, calls = parser.parse(output, request, enable_auto_tools=True)
    return Received(reasoning, content, [{"name": c.name, "arguments": c.arguments} for c in calls or []])


def token_deltas(tokenizer, output: str) -> list[tuple[str, list[int]]]:
    """One delta per token, with its text as the detokenizer gives it (special tokens whole)."""
    ids = tokenizer.encode(output, add_special_tokens=False)
    assert tokenizer.decode(ids) == output, "test outputs must round-trip through the tokenizer"
    return [(tokenizer.decode([i]), [i]) for i in ids]


def parse_stream(parser_cls, tokenizer, request, output: str, prompt_ids=None, chat_template_kwargs=None,
                 deltas=None) -> Received:
    parser = parser_cls(tokenizer, request.tools, chat_template_kwargs=chat_template_kwargs or {})
    deltas = deltas if deltas is not None else token_deltas(tokenizer, output)
    prompt_ids = prompt_ids if prompt_ids is not None else tokenizer.encode("<|start|>user<|message|>hi<|end|><|start|>assistant", add_special_tokens=False)
    got = Received()
    for n, (text, ids) in enumerate(deltas):
        msg = parser.parse_delta(text, ids, request, prompt_token_ids=prompt_ids, finished=n == len(deltas) - 1)
        if msg is None:
            continue
        got.deltas.append(msg)
        if msg.reasoning:
            got.reasoning = (got.reasoning or "") + msg.reasoning
        if msg.content:
            got.content = (got.content or "") + msg.content
        for tc in msg.tool_calls:
            while len(got.calls) <= tc.index:
                got.calls.append({"name": None, "arguments": "", "id": None})
            call = got.calls[tc.index]
            if tc.id:
                call["id"] = tc.id
            if tc.function and tc.function.name:
                call["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                call["arguments"] += tc.function.arguments
    for call in got.calls:
        call.pop("id")
    return got
