"""`beam-hpu demo --fp8`: the FP8 tiny checkpoint it writes, served by the demo's own `vllm serve`
command line, answers a chat completion over HTTP (FP8 experts on the portable path)."""

import pytest
from openai import OpenAI

from beam_hpu.demo.serve import write_checkpoint
from tests.support.server import Server

pytestmark = pytest.mark.slow


def test_demo_fp8_checkpoint_serves_a_chat_completion(tmp_path):
    # What `_demo` writes with --fp8 (preset small, seed 0), through the same function.
    model_dir = write_checkpoint(tmp_path / "demo-fp8", "small", "bfloat16", 0, fp8=True)
    assert "quantization_config" in (model_dir / "config.json").read_text()
    server = Server(model_dir)
    try:
        client = OpenAI(base_url=server.base_url, api_key="none")
        r = client.chat.completions.create(model=server.model, max_tokens=16, temperature=0,
                                           messages=[{"role": "user", "content": "hello"}])
        assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
        log = server.log_text()
    finally:
        server.stop()
    assert "BeamForCausalLM" in log and "compressed-tensors" in log
    assert "Unsupported FP8 MoE backend" not in log
