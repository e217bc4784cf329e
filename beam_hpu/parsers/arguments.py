"""Tool-call arguments: raw `<rfl:parameter>` values -> typed JSON, whole or as streamed deltas.

Beam writes every value as raw text; the tool's JSON schema says what it is. A value whose schema
is a plain string (or that the schema does not describe) stays text and can be streamed as it
arrives: `"key": "` then JSON-escaped pieces then `"`. Any other value (integer, number, boolean,
null, object, array, unions) is typed when it closes and sent whole. JSON escaping is per
character, so the streamed pieces concatenate to exactly `json.dumps(arguments)`.
"""

from __future__ import annotations

import json
import logging

logger = logging.getLogger("vllm.beam_hpu.parsers")

_JSON_TYPES = {"integer": int, "number": (int, float), "boolean": bool, "null": type(None),
               "object": dict, "array": list, "string": str}


def tool_parameter_schemas(tools) -> dict[str, dict]:
    """{tool name: its parameters schema} from OpenAI chat tools (or Responses function tools)."""
    schemas: dict[str, dict] = {}
    for tool in tools or []:
        function = getattr(tool, "function", tool)
        if isinstance(function, dict):
            name, params = function.get("name"), function.get("parameters")
        else:
            name, params = getattr(function, "name", None), getattr(function, "parameters", None)
        if name:
            schemas[name] = params or {}
    return schemas


def _types(schema: dict | None) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    kinds = schema.get("type")
    found = {kinds} if isinstance(kinds, str) else set(kinds or [])
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or []:
            found |= _types(member)
    if "enum" in schema and not found:
        found = {type_name for v in schema["enum"] for type_name, py in _JSON_TYPES.items()
                 if isinstance(v, py) and not (type_name in ("integer", "number") and isinstance(v, bool))}
    if "const" in schema and not found:
        found = {"string"} if isinstance(schema["const"], str) else {"any"}
    return found


def is_text_value(schema: dict | None) -> bool:
    """A value kept as text: schema says string, or says nothing about the type."""
    kinds = _types(schema)
    return not kinds or kinds == {"string"}


def typed_value(raw: str, schema: dict | None):
    """The JSON value of a raw parameter text under its schema; the text itself when it is not
    valid JSON of an allowed type (the model's words are kept, never a crash)."""
    if is_text_value(schema):
        return raw
    kinds = _types(schema)
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    allowed = tuple(py for name, py in _JSON_TYPES.items() if name in kinds) if "any" not in kinds else (object,)
    if isinstance(value, allowed) and not (isinstance(value, bool) and "boolean" not in kinds):
        return value
    return raw


class CallArguments:
    """One call's arguments, assembled from parameter events into a dict and into JSON text
    deltas. `text` is everything produced so far; non-streaming reads `json_text()`."""

    def __init__(self, properties: dict | None):
        self.properties = properties or {}
        self.values: dict = {}
        self.text = ""
        self._open: str | None = None  # key of a text value being streamed
        self._skip = False  # inside a duplicate key's value
        self.broken = False  # the output ended inside a streamed value

    def _emit(self, piece: str) -> str:
        self.text += piece
        return piece

    def _key_prefix(self, key: str) -> str:
        return ("{" if not self.text else ", ") + json.dumps(key, ensure_ascii=False) + ": "

    def open(self, key: str) -> str:
        # A repeated key keeps its first value in both modes: a streamed value cannot be taken back.
        self._skip = key in self.values or key == self._open
        if self._skip:
            logger.warning("beam tool call: parameter %r repeated; keeping the first value", key)
            return ""
        if is_text_value(self.properties.get(key)):
            self._open = key
            return self._emit(self._key_prefix(key) + '"')
        return ""

    def text_piece(self, piece: str) -> str:
        if self._open is None or self._skip:
            return ""
        return self._emit(json.dumps(piece, ensure_ascii=False)[1:-1])

    def close(self, key: str, raw: str) -> str:
        if self._skip:
            self._skip = False
            return ""
        if self._open == key:
            self._open = None
            self.values[key] = raw
            return self._emit('"')
        value = typed_value(raw, self.properties.get(key))
        self.values[key] = value
        return self._emit(self._key_prefix(key) + json.dumps(value, ensure_ascii=False))

    def cut(self, key: str) -> None:
        """The output ended inside `key`'s value: the value is dropped. If part of it was already
        streamed, the client holds argument text that does not parse (documented)."""
        if self._open == key:
            self.broken = True
        self._open = None

    def finish(self) -> str:
        if self.broken:
            return ""
        return self._emit("{}" if not self.text else "}")

    def json_text(self) -> str:
        return json.dumps(self.values, ensure_ascii=False)
