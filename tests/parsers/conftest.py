"""Shared fixtures: the tiny Beam tokenizer (with the chat template and response_template the
checkpoint ships) and the parser class vLLM 0.30.0's chat server composes (the tools, requests and
model outputs the tests share live in tests/support/parsers.py)."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest  # noqa: E402

from beam_hpu.tiny.checkpoint import write_tokenizer  # noqa: E402

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
