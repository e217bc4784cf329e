"""Beam's response template: the one source of truth for the output format.

The checkpoint describes its own output format as data (`tokenizer_config.json["response_template"]`,
`response_template.json` next to this file is the published one). Everything format-specific in the parsers and the
grammar is derived here from that object: the start anchor, the openers (regexes expanded to their
literal forms), the closers, the control tokens, and the `<rfl:parameter>` framing.

The only facts not in the template are how the chat template lays values out inside a parameter
(a newline on each side, a newline between parameters). The template's `strip: true` makes parsing
indifferent to them; the grammar pins them to what the chat template renders, so the model is kept
on the layout it was trained on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# The layout of a value inside `<rfl:parameter name="k">` ... `</rfl:parameter>` and between
# parameters, as the chat template renders it (`beam_hpu/tiny/data/chat_template.jinja` for the tiny Beam).
VALUE_PREFIX = "\n"
VALUE_SUFFIX = "\n"
PARAMETER_SEPARATOR = "\n"

REQUIRED_FIELDS = ("thinking", "content", "tool_calls")
CONTROL_TOKEN_RE = re.compile(r"<\|[a-z_]+\|>")
CONTROL_TOKEN_PREFIX = "<|"  # every control token begins so
# The published checkpoint's response_template (the Beam format as data), for code that has no
# checkpoint at hand: the tiny checkpoints, the gate suite.
BUNDLED_TEMPLATE = Path(__file__).with_name("response_template.json")


class ResponseTemplateError(ValueError):
    """The checkpoint's response_template is missing or not the shape the `beam` parsers serve."""


# ---------------------------------------------------------------------------------------------
# Literal expansion of the template's opener regexes. The template uses a small regex subset:
# escaped characters, `(?:...)` groups with `?` and `|`, and named groups that capture a value.
# Anything else is refused: a parser and a grammar derived from a misread pattern would disagree.


def expand_literals(pattern: str) -> list[str]:
    """All literal strings a pattern can match, named groups left as `{name}` placeholders.

    Alternatives with every optional part present come first: that is the canonical form, the
    one the chat template renders.
    """
    alternatives, end = _expand_sequence(pattern, 0)
    if end != len(pattern):
        raise ResponseTemplateError(f"unbalanced ')' at {end} in pattern {pattern!r}")
    return alternatives


def _expand_sequence(p: str, i: int) -> tuple[list[str], int]:
    branches: list[list[str]] = [[""]]
    while i < len(p) and p[i] != ")":
        if p[i] == "|":
            branches.append([""])
            i += 1
            continue
        if p.startswith("(?P<", i):
            close = p.index(">", i)
            name = p[i + 4 : close]
            depth, j = 1, close + 1
            while depth:
                depth += {"(": 1, ")": -1}.get(p[j], 0) if p[j - 1] != "\\" else 0
                j += 1
            pieces, i = ["{" + name + "}"], j
        elif p.startswith("(?:", i):
            pieces, i = _expand_sequence(p, i + 3)
            i += 1  # the closing ')'
            if i < len(p) and p[i] == "?":
                pieces, i = pieces + [""], i + 1
        elif p[i] == "\\":
            pieces, i = [p[i + 1]], i + 2
        elif p[i] in ".*+?[]{}^$(":
            raise ResponseTemplateError(f"unsupported regex syntax {p[i]!r} at {i} in {p!r}")
        else:
            pieces, i = [p[i]], i + 1
        branches[-1] = [head + piece for head in branches[-1] for piece in pieces]
    return [alt for branch in branches for alt in branch], i


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResponseTemplate:
    raw: dict
    anchor: str  # written before every assistant message; the generation prompt ends with it
    thinking_open: re.Pattern
    thinking_openers: tuple[str, ...]
    thinking_closers: tuple[str, ...]
    content_open: re.Pattern
    content_openers: tuple[str, ...]
    content_closers: tuple[str, ...]
    call_open: re.Pattern
    call_openers: tuple[str, ...]  # with `{name}`; canonical first
    call_closers: tuple[str, ...]  # [0] closes the last call (an EOS token), [1] one that continues
    parameter_begin: tuple[str, str]  # `<rfl:parameter name="` and `">` around the key
    parameter_end: str
    strip_values: bool
    control_tokens: tuple[str, ...]
    anchor_token: str  # the control token the anchor starts with (`<|start|>`)
    header_end: str  # the control token that ends every message header (`<|message|>`)

    # -- openers as written at the start of the output (the prompt already holds the anchor) and
    # -- after an earlier message (anchor written by the model)

    @property
    def anchor_role(self) -> str:
        """The anchor after its control token: the role every output message is written as."""
        return self.anchor[len(self.anchor_token):]

    def first_opener(self, opener: str) -> str:
        return opener[len(self.anchor) :] if opener.startswith(self.anchor) else opener

    def later_opener(self, opener: str) -> str:
        return opener if opener.startswith(self.anchor) else self.anchor + opener

    def call_opener(self, name: str) -> str:
        return self.call_openers[0].replace("{name}", name)

    def classify_header(self, header: str) -> tuple[str | None, str | None]:
        """Which field a message header (the text between the anchor and `<|message|>`, with
        `<|message|>`) opens: ("thinking"|"content"|"tool_calls"|None, tool name)."""
        for text in (header, self.anchor + header):
            if self.thinking_open.fullmatch(text):
                return "thinking", None
            if self.content_open.fullmatch(text):
                return "content", None
            m = self.call_open.fullmatch(text)
            if m:
                return "tool_calls", m.group("name").strip()
        return None, None

    def closers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.thinking_closers + self.content_closers + self.call_closers))


def _as_tuple(value) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _field(raw: dict, name: str) -> dict:
    try:
        return raw["fields"][name]
    except (KeyError, TypeError):
        raise ResponseTemplateError(
            f"response_template has no `fields.{name}`: the `beam` parsers need thinking, content "
            "and tool_calls fields"
        ) from None


def _parameter_framing(tag_pattern: str) -> tuple[tuple[str, str], str]:
    """`<rfl:parameter name="(?P<key>...)">(?P<value>.*?)</rfl:parameter>` -> the literals."""
    m = re.fullmatch(r"(.*)\(\?P<key>[^)]*\)(.*)\(\?P<value>[^)]*\)(.*)", tag_pattern)
    if not m:
        raise ResponseTemplateError(f"tool_calls.content_args.tag_pattern {tag_pattern!r}: expected key then value groups")
    literals = [expand_literals(part) for part in m.groups()]
    if any(len(lit) != 1 for lit in literals):
        raise ResponseTemplateError(f"tool_calls.content_args.tag_pattern {tag_pattern!r}: framing must be literal")
    (before,), (between,), (after,) = literals
    return (before, between), after


def parse_response_template(raw: dict) -> ResponseTemplate:
    if not isinstance(raw, dict):
        raise ResponseTemplateError("response_template must be an object")
    for name in REQUIRED_FIELDS:
        _field(raw, name)
    if "start_anchor_pattern" not in raw:
        raise ResponseTemplateError("response_template has no `start_anchor_pattern`")
    (anchor,) = expand_literals(raw["start_anchor_pattern"])
    thinking, content, calls = (_field(raw, n) for n in REQUIRED_FIELDS)
    if calls.get("content") != "xml-inline":
        raise ResponseTemplateError(f"tool_calls.content is {calls.get('content')!r}; Beam writes 'xml-inline' arguments")
    args = calls.get("content_args") or {}
    if "tag_pattern" not in args:
        raise ResponseTemplateError("response_template has no `fields.tool_calls.content_args.tag_pattern`")
    parameter_begin, parameter_end = _parameter_framing(args["tag_pattern"])
    value_parser = args.get("value_parser") or {}
    call_openers = tuple(expand_literals(calls["open_pattern"]))
    if not call_openers[0].startswith(anchor) or "{name}" not in call_openers[0]:
        raise ResponseTemplateError("tool_calls.open_pattern: the canonical opener must start with the anchor and hold `name`")
    t = ResponseTemplate(
        raw=raw,
        anchor=anchor,
        thinking_open=re.compile(thinking["open_pattern"], re.DOTALL),
        thinking_openers=tuple(expand_literals(thinking["open_pattern"])),
        thinking_closers=_as_tuple(thinking["close"]),
        content_open=re.compile(content["open_pattern"], re.DOTALL),
        content_openers=tuple(expand_literals(content["open_pattern"])),
        content_closers=_as_tuple(content["close"]),
        call_open=re.compile(calls["open_pattern"], re.DOTALL),
        call_openers=call_openers,
        call_closers=_as_tuple(calls["close"]),
        parameter_begin=parameter_begin,
        parameter_end=parameter_end,
        strip_values=bool((value_parser.get("args") or {}).get("strip", False)),
        control_tokens=(),
        anchor_token="",
        header_end="",
    )
    literal_text = json.dumps([anchor, *t.thinking_openers, *t.content_openers, *call_openers, *t.closers()])
    controls = tuple(dict.fromkeys(CONTROL_TOKEN_RE.findall(literal_text)))
    anchor_token = CONTROL_TOKEN_RE.match(anchor)
    if anchor_token is None:
        raise ResponseTemplateError(f"start_anchor_pattern {anchor!r}: the anchor must begin with a control token")
    header_ends = {CONTROL_TOKEN_RE.findall(o)[-1] if CONTROL_TOKEN_RE.search(o) else None
                   for o in (*t.thinking_openers, *t.content_openers, *call_openers)}
    if len(header_ends) != 1 or None in header_ends:
        raise ResponseTemplateError(f"every opener must end its header with the same control token; got {header_ends}")
    return ResponseTemplate(**{**t.__dict__, "control_tokens": controls, "anchor_token": anchor_token.group(),
                               "header_end": header_ends.pop()})


def bundled_template() -> ResponseTemplate:
    return _parse_cached(json.dumps(json.loads(BUNDLED_TEMPLATE.read_text()), sort_keys=True))


@lru_cache(maxsize=8)
def _parse_cached(raw_json: str) -> ResponseTemplate:
    return parse_response_template(json.loads(raw_json))


def response_template_of(tokenizer) -> ResponseTemplate:
    """The template from a tokenizer (HF `init_kwargs`, else the `tokenizer_config.json` next to it).

    Raises ResponseTemplateError naming the missing field: a `beam` server must not start without
    the format description it parses and constrains by.
    """
    raw = (getattr(tokenizer, "init_kwargs", None) or {}).get("response_template")
    if raw is None:
        path = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "tokenizer_config.json"
        if path.is_file():
            raw = json.loads(path.read_text()).get("response_template")
    if raw is None:
        raise ResponseTemplateError(
            "--reasoning-parser/--tool-call-parser beam requires `response_template` in the "
            "tokenizer configuration (tokenizer_config.json); this checkpoint has none"
        )
    return _parse_cached(json.dumps(raw, sort_keys=True))
