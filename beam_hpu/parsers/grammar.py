"""The response grammar: an xgrammar structural tag for a whole Beam turn, from its first token.

Derived from the response template (openers, closers, control tokens, parameter framing) and the
request (tools, tool_choice, parallel_tool_calls, answer format, thinking on/off):

    thinking on:   THINK (ANSWER | CALLS)        thinking off:  ANSWER | CALLS (first-message form)
    THINK   = `<|channel|>analysis<|message|>` non-empty text `<|end|>`
    ANSWER  = `<|start|>assistant<|channel|>final<|message|>` text | the requested answer format
    CALLS   = CALL (`<|end|>` CALL)*             (one CALL when parallel calls are off or named)
    CALL    = `<|start|>assistant to=NAME<|channel|>analysis <|constrain|>xml<|message|>` PARAMS
    PARAMS  = per property, sorted by name (the order Beam writes), required ones mandatory:
              `\n`? `<rfl:parameter name="K">\n` VALUE `\n</rfl:parameter>`

The last closer (`<|return|>` after an answer, `<|call|>` after the last call) is an EOS token:
the grammar ends before it and the matcher accepts a stop token there. Free text never contains a
control token or parameter markup, so the parsers' reading of the output is never ambiguous. Control tokens are
matched as the special tokens themselves (`token` formats), never spelled out in ordinary tokens:
a random-weight model served through vLLM did spell `<|message|>` as `<|`, `messa`, ... when the
grammar only matched the text, and the token-level questions (reasoning end, reasoning token
counts) read special-token ids.
"""

from __future__ import annotations

from beam_hpu.parsers.arguments import is_text_value
from beam_hpu.parsers.template import (
    CONTROL_TOKEN_RE,
    PARAMETER_SEPARATOR,
    VALUE_PREFIX,
    VALUE_SUFFIX,
    ResponseTemplate,
)

# First character(s) of a non-empty text that cannot start a control token (all begin with "<|").
_NON_EMPTY_START = "[^<]|<[^|]"


def _const(value: str) -> dict:
    return {"type": "const_string", "value": value}


def _seq(*elements) -> dict:
    elements = [e for e in elements if e is not None]
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def _or(*elements) -> dict:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": list(elements)}


class ResponseGrammar:
    """Builds the structural tag for one request from the template. `vocab`: the tokenizer's
    token -> id map; control tokens are given by id because vLLM validates a structural tag
    without a tokenizer, where token strings cannot be resolved."""

    def __init__(self, t: ResponseTemplate, vocab: dict[str, int]):
        self.t = t
        missing = [c for c in t.control_tokens if c not in vocab]
        if missing:
            raise ValueError(f"the tokenizer lacks the response template's control tokens {missing}")
        self.ids = {c: vocab[c] for c in t.control_tokens}
        # Reasoning and answers never contain tool-call markup either: a model that wants to call
        # a tool where no call is allowed (tool_choice none) otherwise writes the parameter tags
        # into its answer, and the client sees `<rfl:parameter ...>` as content.
        tag_name = t.parameter_begin[0].split(" ")[0]  # `<rfl:parameter`
        closing = "</" + tag_name[1:]
        self.free_text = {"type": "any_text", "excludes": [*t.control_tokens, tag_name, closing]}

    def _token(self, text: str) -> dict:
        return {"type": "token", "token": self.ids[text]}

    def _literal(self, text: str) -> dict:
        """A literal with its control tokens as the special tokens and the rest as text."""
        pieces, at = [], 0
        for m in CONTROL_TOKEN_RE.finditer(text):
            if m.start() > at:
                pieces.append(_const(text[at : m.start()]))
            pieces.append(self._token(m.group(0)))
            at = m.end()
        if at < len(text):
            pieces.append(_const(text[at:]))
        return _seq(*pieces) if pieces else _const("")

    def thinking(self) -> dict:
        opener = self.t.first_opener(self.t.thinking_openers[0])
        last = list(CONTROL_TOKEN_RE.finditer(opener))[-1]
        assert last.end() == len(opener), "the thinking opener ends with a control token"
        body = {
            "type": "tag",
            "begin": self._token(last.group(0)),
            "content": _seq({"type": "regex", "pattern": _NON_EMPTY_START}, self.free_text),
            "end": self._token(self.t.thinking_closers[0]),
        }
        return _seq(self._literal(opener[: last.start()]), body) if last.start() else body

    def answer(self, first: bool, body: dict | None) -> dict:
        opener = self.t.content_openers[0]
        opener = self.t.first_opener(opener) if first else self.t.later_opener(opener)
        return _seq(self._literal(opener), body or self.free_text)

    def value(self, schema: dict | None) -> dict:
        schema = schema if isinstance(schema, dict) else {}
        if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
            return _or(*(_const(v) for v in schema["enum"]))
        if isinstance(schema.get("const"), str):
            return _const(schema["const"])
        if is_text_value(schema):
            if schema.get("pattern"):
                return {"type": "regex", "pattern": schema["pattern"]}
            return {"type": "any_text", "excludes": [*self.t.control_tokens, self.t.parameter_end]}
        return {"type": "json_schema", "json_schema": schema}

    def parameters(self, schema: dict | None) -> dict:
        schema = schema if isinstance(schema, dict) else {}
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        begin, between = self.t.parameter_begin
        items = []
        for key in sorted(properties):
            tag = {
                "type": "tag",
                "begin": begin + key + between + VALUE_PREFIX,
                "content": self.value(properties[key]),
                "end": VALUE_SUFFIX + self.t.parameter_end,
            }
            item = _seq({"type": "regex", "pattern": f"{PARAMETER_SEPARATOR}?"}, tag)
            items.append(item if key in required else {"type": "optional", "content": item})
        return _seq(*items) if items else _const("")

    def call(self, name: str, schema: dict | None, first: bool) -> dict:
        opener = self.t.call_opener(name)
        opener = self.t.first_opener(opener) if first else opener
        return _seq(self._literal(opener), self.parameters(schema))

    def calls(self, tools: dict[str, dict], first: bool, parallel: bool) -> dict:
        one = _or(*(self.call(n, s, first) for n, s in tools.items()))
        if not parallel:
            return one
        more = _or(*(self.call(n, s, False) for n, s in tools.items()))
        separator = self.t.call_closers[-1]  # the closer of a call that another message follows
        return _seq(one, {"type": "star", "content": _seq(self._literal(separator), more)})

    def structural_tag(
        self,
        *,
        thinking: bool,
        tools: dict[str, dict],
        allow_answer: bool,
        parallel: bool,
        answer_body: dict | None = None,
    ) -> dict:
        """`tools`: the tools the model may call ({} = no calls); at least one of calls/answer."""
        if not tools and not allow_answer:
            raise ValueError("a Beam turn needs an answer or a tool call to be allowed")
        first = not thinking

        def rest() -> dict:
            options = []
            if allow_answer:
                options.append(self.answer(first, answer_body))
            if tools:
                options.append(self.calls(tools, first, parallel))
            return _or(*options)

        fmt = _seq(self.thinking(), rest()) if thinking else rest()
        return {"type": "structural_tag", "format": fmt}
