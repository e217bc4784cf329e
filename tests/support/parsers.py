"""What the parser tests share: the tools a request offers, a chat request as vLLM 0.30.0's chat
server builds it, and hand-written model outputs in Beam's harmony-style format (reasoning, then
tool calls whose parameters are XML-like blocks, or a final answer)."""

from __future__ import annotations


def tool(name: str, properties: dict, required: list[str], **extra) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, **extra, "parameters": parameters}}


WEATHER = tool(
    "get_weather",
    {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    ["city"],
    description="Weather for a city",
)
TYPED = tool(
    "typed",
    {
        "a_int": {"type": "integer"},
        "b_num": {"type": "number"},
        "c_bool": {"type": "boolean"},
        "d_null": {"type": "null"},
        "e_obj": {"type": "object"},
        "f_arr": {"type": "array", "items": {"type": "integer"}},
        "g_str": {"type": "string"},
    },
    ["a_int"],
)
TOOLS = [WEATHER, TYPED]


def chat_request(tools=None, **kw):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="beam", messages=[{"role": "user", "content": "hi"}], tools=tools, **kw)


THINK = "<|channel|>analysis<|message|>The user wants weather.<|end|>"
CALL_OPEN = "<|start|>assistant to={}<|channel|>analysis <|constrain|>xml<|message|>"


def param(key, value):
    return f'<rfl:parameter name="{key}">\n{value}\n</rfl:parameter>'


def call(name, *params):
    return CALL_OPEN.format(name) + "\n".join(param(k, v) for k, v in params)


ANSWER = THINK + "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
ONE_CALL = THINK + call("get_weather", ("city", "Paris"), ("days", "2"))
TYPED_CALL = THINK + call(
    "typed",
    ("a_int", "7"),
    ("b_num", "2.5"),
    ("c_bool", "true"),
    ("d_null", "null"),
    ("e_obj", '{"k": [1, "x"]}'),
    ("f_arr", "[1, 2, 3]"),
    ("g_str", 'say "hi"\nback\\slash'),
)
PARALLEL = THINK + call("get_weather", ("city", "Paris")) + "<|end|>" + call("get_weather", ("city", "Oslo"), ("unit", "celsius"))
