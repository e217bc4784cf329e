"""What a Beam request may contain, checked before it is rendered or constrained; each refusal is
a 400 (VLLMValidationError) whose message names the message index, tool, or schema path at fault.

- Roles: Beam's chat format knows system, developer, user, assistant and tool; any other role
  would be rendered as a turn the model was never trained on.
- Tool names: letters, digits, `_`, `.`, `-`, at most 64 characters (what OpenAI-compatible
  servers accept, with the `.` Beam's own tools use), unique within the request. A name is
  written raw into the `to=NAME` header, so anything else is markup waiting to happen.
- Schemas (tool parameters, `response_format`, `structured_outputs.json`): the faults the grammar
  compiler would otherwise report by an internal key (`Invalid grammar specification:
  'triggers'`): unknown `type`, a `type` that is not a string, a `$ref` that does not resolve,
  an `enum` whose values the declared type or Beam's raw-text values make ambiguous, `required`
  naming a property the schema does not have, a `pattern` that is not a regex; anything else
  the grammar compiler refuses, with its reason, on the tool parameter it belongs to.
"""

from __future__ import annotations

import functools
import json
import re

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
JSON_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "contains", "if", "then", "else")


def bad_request(message: str, parameter: str):
    from vllm.exceptions import VLLMValidationError

    return VLLMValidationError(message, parameter=parameter)


def _get(obj, key):
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def tool_name_fault(name) -> str | None:
    if not isinstance(name, str) or not name:
        return "a tool needs a non-empty string name"
    if len(name) > 64:
        return f"tool name {name[:64]!r}... is {len(name)} characters long; at most 64 are allowed"
    if not TOOL_NAME.fullmatch(name):
        return f"tool name {name!r} may hold only letters, digits, '_', '.' and '-'"
    return None


def check_conversation(messages) -> None:
    """Roles, and the tool names in history tool calls and tool results."""
    for i, message in enumerate(messages or []):
        role = _get(message, "role")
        if role not in ROLES:
            raise bad_request(f"messages[{i}]: role {role!r} is not one of {', '.join(ROLES)}", f"messages[{i}].role")
        for j, call in enumerate(_get(message, "tool_calls") or []):
            name = _get(_get(call, "function") or call, "name")
            fault = tool_name_fault(name)
            if fault:
                raise bad_request(f"messages[{i}].tool_calls[{j}]: {fault}", f"messages[{i}].tool_calls[{j}].function.name")
        if role == "tool" and _get(message, "name") is not None:
            fault = tool_name_fault(_get(message, "name"))
            if fault:
                raise bad_request(f"messages[{i}]: {fault}", f"messages[{i}].name")


def tool_functions(tools) -> list[tuple[int, str, dict | None]]:
    """[(index, name, parameters)] of OpenAI chat tools, given as dicts or pydantic objects."""
    found = []
    for i, tool in enumerate(tools or []):
        function = _get(tool, "function") or tool
        found.append((i, _get(function, "name"), _get(function, "parameters")))
    return found


def check_tools(tools) -> None:
    """Tool names: pattern, length, uniqueness."""
    seen: dict[str, int] = {}
    for i, name, _ in tool_functions(tools):
        fault = tool_name_fault(name)
        if fault:
            raise bad_request(f"tools[{i}]: {fault}", f"tools[{i}].function.name")
        if name in seen:
            raise bad_request(f"tools[{i}]: tool name {name!r} is already used by tools[{seen[name]}]",
                              f"tools[{i}].function.name")
        seen[name] = i


def check_tool_schemas(tools) -> None:
    for i, name, parameters in tool_functions(tools):
        if parameters is None:
            continue
        fault = schema_fault(parameters)
        if fault:
            path, reason = fault
            raise bad_request(f"tools[{i}] {name!r}: parameters{path}: {reason}", f"tools[{i}].function.parameters")


def check_answer_schema(schema, where: str) -> None:
    fault = schema_fault(schema)
    if fault:
        path, reason = fault
        raise bad_request(f"{where}{path}: {reason}", where)


# ---------------------------------------------------------------------------------------------


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", type(None): "null", dict: "object", list: "array"}.get(type(value), "?")


def _matches(value, kinds) -> bool:
    kind = _json_type(value)
    return kind in kinds or (kind == "integer" and "number" in kinds)


def _resolve(root, ref: str):
    if not ref.startswith("#"):
        return None, f"$ref {ref!r} is not local (only '#/...' references into this schema are supported)"
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None, f"$ref {ref!r} does not resolve in this schema (no {part!r})"
    return node, None


def schema_fault(schema, root=None, path: str = "") -> tuple[str, str] | None:
    """(path, reason) of the first fault in a JSON schema, or None. Paths read like
    `.properties.unit.type`."""
    root = schema if root is None else root
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return path, f"a schema must be an object, got {_json_type(schema)}"
    kinds = schema.get("type")
    if kinds is not None:
        listed = kinds if isinstance(kinds, list) else [kinds]
        if not listed or not all(isinstance(k, str) for k in listed):
            return path + ".type", f"`type` must be a type name or a list of them, got {kinds!r}"
        unknown = [k for k in listed if k not in JSON_TYPES]
        if unknown:
            return path + ".type", f"unknown type {unknown[0]!r} (JSON schema types: {', '.join(JSON_TYPES)})"
    if "$ref" in schema:
        ref = schema["$ref"]
        if not isinstance(ref, str):
            return path + ".$ref", f"$ref must be a string, got {ref!r}"
        _, reason = _resolve(root, ref)
        if reason:
            return path + ".$ref", reason
    if "enum" in schema:
        fault = _enum_fault(schema["enum"], kinds)
        if fault:
            return path + ".enum", fault
    if "pattern" in schema:
        try:
            re.compile(schema["pattern"])
        except (re.error, TypeError) as e:
            return path + ".pattern", f"pattern {schema['pattern']!r} is not a regular expression ({e})"
    properties = schema.get("properties")
    if "required" in schema:
        required = schema["required"]
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            return path + ".required", f"`required` must be a list of property names, got {required!r}"
        names = properties if isinstance(properties, dict) else {}
        missing = [r for r in required if r not in names]
        if missing:
            return path + ".required", f"names {missing[0]!r}, which is not among the properties ({', '.join(names) or 'none'})"
    for key in _SUBSCHEMA_MAPS:
        if key in schema:
            members = schema[key]
            if not isinstance(members, dict):
                return path + "." + key, f"`{key}` must be an object of schemas, got {_json_type(members)}"
            for name, member in members.items():
                fault = schema_fault(member, root, f"{path}.{key}.{name}")
                if fault:
                    return fault
    for key in _SUBSCHEMA_LISTS:
        if key in schema:
            members = schema[key]
            if not isinstance(members, list) or not members:
                return path + "." + key, f"`{key}` must be a non-empty list of schemas"
            for j, member in enumerate(members):
                fault = schema_fault(member, root, f"{path}.{key}[{j}]")
                if fault:
                    return fault
    for key in _SUBSCHEMAS:
        if key in schema:
            fault = schema_fault(schema[key], root, f"{path}.{key}")
            if fault:
                return fault
    return None


def _enum_fault(values, kinds) -> str | None:
    if not isinstance(values, list) or not values:
        return f"`enum` must be a non-empty list, got {values!r}"
    declared = kinds if isinstance(kinds, list) else [kinds] if isinstance(kinds, str) else None
    if declared:
        wrong = [v for v in values if not _matches(v, declared)]
        if wrong:
            return f"value {wrong[0]!r} is not of the declared type {kinds!r}"
        return None
    strings = [v for v in values if isinstance(v, str)]
    if strings and len(strings) != len(values):
        other = next(v for v in values if not isinstance(v, str))
        return (f"mixes strings with {_json_type(other)} values ({strings[0]!r}, {other!r}): Beam writes "
                "argument values as raw text, where the two cannot be told apart; declare `type` or use one kind")
    return None


# ---------------------------------------------------------------------------------------------
# What the static checks above do not know, the grammar compiler finds (`minimum: "x"`, a
# lookbehind in `pattern`, ...); vLLM would then answer "Invalid structural tag specification."
# naming nothing. The request's grammar is compiled once here (cached by its text: agents resend
# the same tools) and, when refused, each schema on its own to name the one at fault.

_COMPILER_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+:[0-9]+: ")


@functools.lru_cache(maxsize=256)
def _refusal(tag_json: str) -> str | None:
    try:
        import xgrammar as xgr
    except ImportError:  # another structured-output backend: it reports its own errors
        return None
    try:
        xgr.Grammar.from_structural_tag(tag_json)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with the reason as text
        return _COMPILER_PREFIX.sub("", str(e).strip()) or type(e).__name__
    return None


def grammar_refusal(fmt: dict) -> str | None:
    """The grammar compiler's reason for refusing a structural-tag format, None if it compiles."""
    tag = fmt if fmt.get("type") == "structural_tag" else {"type": "structural_tag", "format": fmt}
    return _refusal(json.dumps(tag, sort_keys=True))


def check_grammar_compiles(tag: dict, value_format, tools, answer: tuple[str, dict] | None) -> None:
    """Raise a 400 naming the tool parameter (or answer schema) whose grammar does not compile.
    `value_format(schema)`: the grammar of one parameter value; `answer`: (where, its format)."""
    reason = grammar_refusal(tag)
    if reason is None:
        return
    for i, name, parameters in tool_functions(tools):
        properties = (parameters or {}).get("properties") or {} if isinstance(parameters, dict) else {}
        for key in sorted(properties):
            why = grammar_refusal(value_format(properties[key]))
            if why:
                raise bad_request(f"tools[{i}] {name!r}: parameters.properties.{key}: the grammar compiler refuses "
                                  f"this schema: {why}", f"tools[{i}].function.parameters")
    if answer is not None:
        where, fmt = answer
        why = grammar_refusal(fmt)
        if why:
            raise bad_request(f"{where}: the grammar compiler refuses this schema: {why}", where)
    raise bad_request(f"the response grammar for this request does not compile: {reason}", "tools")
