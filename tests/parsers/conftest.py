"""Shared fixtures: the tiny Beam tokenizer (with the chat template and response_template the
checkpoint ships) and helpers that drive the parsers the way vLLM 0.30.0's chat server does."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest  # noqa: E402

from beam_hpu.tiny.checkpoint import write_tokenizer  # noqa: E402

def _tool(name: str, properties: dict, required: list[str], **extra) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, **extra, "parameters": parameters}}


WEATHER = _tool(
    "get_weather",
    {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    ["city"],
    description="Weather for a city",
)
TYPED = _tool(
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


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("beam_tokenizer")
    write_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="session")
def template(tokenizer):
    from beam_hpu.parsers.template import response_template_of

    return response_template_of(tokenizer)


@pytest.fixture(scope="session")
def parser_cls():
    """The parser class vLLM's chat server composes for `--reasoning-parser beam
    --tool-call-parser beam --enable-auto-tool-choice`."""
    import beam_hpu.parsers
    from vllm.parser import ParserManager

    beam_hpu.parsers.register()
    return ParserManager.get_parser(tool_parser_name="beam", reasoning_parser_name="beam", enable_auto_tools=True)


def chat_request(tools=None, **kw):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="beam", messages=[{"role": "user", "content": "hi"}], tools=tools, **kw)
