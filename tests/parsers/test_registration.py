"""Registration with vLLM 0.30.0's parser managers, the processes that build the parsers, the
startup refusal of a checkpoint without a response_template, and the token-level answers."""

from __future__ import annotations

import json

import pytest


def test_register_is_lazy_and_idempotent():
    import beam_hpu.parsers
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    beam_hpu.parsers.register()
    beam_hpu.parsers.register()
    assert ReasoningParserManager.lazy_parsers["beam"] == ("beam_hpu.parsers.reasoning", "BeamReasoningParser")
    assert ToolParserManager.lazy_parsers["beam"] == ("beam_hpu.parsers.tools", "BeamToolParser")
    assert ReasoningParserManager.get_reasoning_parser("beam").__name__ == "BeamReasoningParser"
    assert ToolParserManager.get_tool_parser("beam").__name__ == "BeamToolParser"


def test_built_the_ways_vllm_builds_it(tokenizer, parser_cls):
    from beam_hpu.parsers.reasoning import BeamReasoningParser

    BeamReasoningParser(tokenizer)  # ReasoningConfig at startup: no kwargs
    engine_side = BeamReasoningParser(tokenizer=tokenizer, chat_template_kwargs={"enable_thinking": False})
    assert engine_side.thinking is False
    assert parser_cls.reasoning_parser_cls is BeamReasoningParser
    assert BeamReasoningParser(tokenizer).reasoning_start_str == "<|channel|>analysis<|message|>"
    assert BeamReasoningParser(tokenizer).reasoning_end_str == "<|end|>"


def test_startup_refuses_a_checkpoint_without_response_template(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    from beam_hpu.parsers.reasoning import BeamReasoningParser
    from beam_hpu.parsers.template import ResponseTemplateError, parse_response_template

    tokenizer.save_pretrained(str(tmp_path))
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    raw = cfg.pop("response_template")
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ResponseTemplateError, match="requires `response_template` in the tokenizer configuration"):
        BeamReasoningParser(AutoTokenizer.from_pretrained(str(tmp_path)))
    for field in ("thinking", "content", "tool_calls"):
        broken = json.loads(json.dumps(raw))
        del broken["fields"][field]
        with pytest.raises(ResponseTemplateError, match=f"no `fields.{field}`"):
            parse_response_template(broken)


def test_template_literals(template):
    assert template.anchor == "<|start|>assistant"
    assert template.call_opener("f") == "<|start|>assistant to=f<|channel|>analysis <|constrain|>xml<|message|>"
    assert template.parameter_begin == ('<rfl:parameter name="', '">') and template.parameter_end == "</rfl:parameter>"
    assert template.call_closers == ("<|call|>", "<|end|>") and template.strip_values


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_is_reasoning_end(tokenizer):
    from beam_hpu.parsers.reasoning import BeamReasoningParser

    parser = BeamReasoningParser(tokenizer)
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "reasoning": "r", "content": "b"},
               {"role": "user", "content": "c"}]
    prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    cases = {
        prompt: False,  # history holds closed reasoning, but this turn has not begun
        prompt + "<|channel|>analysis<|message|>thinking": False,
        prompt + "<|channel|>analysis<|message|>thought<|end|>": True,
        prompt + "<|channel|>analysis<|message|>thought<|end|><|start|>assistant<|channel|>final<|message|>x": True,
        prompt + "<|channel|>final<|message|>x": True,  # no reasoning at all (thinking off)
        "<|channel|>analysis<|message|>thinking": False,  # output alone
        "<|channel|>analysis<|message|>thought<|end|>": True,
        prompt[: -len("<|start|>assistant")]: False,  # a user turn
    }
    for text, ended in cases.items():
        assert parser.is_reasoning_end(_ids(tokenizer, text)) is ended, text[-60:]


def test_count_reasoning_tokens(tokenizer):
    from beam_hpu.parsers.reasoning import BeamReasoningParser

    parser = BeamReasoningParser(tokenizer)
    body = _ids(tokenizer, "think about it")
    out = _ids(tokenizer, "<|channel|>analysis<|message|>") + body + _ids(tokenizer, "<|end|><|start|>assistant<|channel|>final<|message|>x")
    assert parser.count_reasoning_tokens(out) == len(body)
    assert parser.count_reasoning_tokens(_ids(tokenizer, "<|channel|>final<|message|>x")) == 0
