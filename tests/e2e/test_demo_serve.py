"""The main job: a tiny Beam served by a real `vllm serve` with our plugin, spoken to over HTTP
with the official openai client, as the README tells a user to."""

import subprocess
import sys

import pytest
from openai import OpenAI

from tests.support.server import Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_bf16):
    s = Server(tiny_bf16)
    yield s
    s.stop()


def test_models_lists_the_served_tiny_beam(server):
    client = OpenAI(base_url=server.base_url, api_key="none")
    assert [m.id for m in client.models.list().data] == [server.model]


def test_chat_completion_returns_generated_tokens(server):
    client = OpenAI(base_url=server.base_url, api_key="none")
    r = client.chat.completions.create(model=server.model, max_tokens=16, temperature=0,
                                       messages=[{"role": "user", "content": "hello"}])
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    # The plugin's model served it (vLLM names the architecture it resolved).
    assert "BeamForCausalLM" in server.log_text()


def test_completions_are_deterministic_at_temperature_zero(server):
    client = OpenAI(base_url=server.base_url, api_key="none")
    outs = [client.completions.create(model=server.model, prompt="the model reads", max_tokens=12,
                                      temperature=0).choices[0].text for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0]) > 0


def test_demo_print_only_names_the_recipe_flags(tmp_path):
    out = subprocess.run([sys.executable, "-m", "beam_hpu.cli", "demo", "--dir", str(tmp_path / "d"),
                          "--print-only"], capture_output=True, text=True, check=True).stdout
    for flag in ("--dtype bfloat16", "--block-size 128", "--max-num-seqs 16", "--enable-prefix-caching",
                 "--max-num-batched-tokens 4096", "--enable-prompt-tokens-details"):
        assert flag in out
    # The demo serves the committed tiny trained Beam by default, byte for byte.
    from beam_hpu.tiny.checkpoint import TRAINED_DIR

    weights = "model-00001-of-00001.safetensors"
    assert (tmp_path / "d" / weights).read_bytes() == (TRAINED_DIR / weights).read_bytes()


def test_tiny_trained_refuses_dtype_and_seed_it_cannot_honour(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "beam_hpu.cli", "tiny", str(tmp_path / "t"), "--preset", "trained",
                           "--dtype", "float32"], capture_output=True, text=True)
    assert proc.returncode != 0 and "--dtype and --seed do not apply" in proc.stderr
    assert not (tmp_path / "t").exists()  # nothing half-written
    ok = subprocess.run([sys.executable, "-m", "beam_hpu.cli", "tiny", str(tmp_path / "t"), "--preset", "trained"],
                        capture_output=True, text=True, check=True)
    assert "wrote tiny Beam (trained" in ok.stdout and (tmp_path / "t" / "config.json").exists()
