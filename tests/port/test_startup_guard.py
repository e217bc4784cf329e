"""The port's startup guards where vLLM calls them: `vllm serve`'s argument validation and every
engine start (beam_hpu/startup.py, installed by register())."""

from __future__ import annotations

import subprocess
import sys
import types
from types import SimpleNamespace

import pytest

from beam_hpu import startup
from beam_hpu.envs import StartupError
from tests.support.engines import REPO, cpu_env


def test_beam_launch_is_told_by_parsers_loader_or_checkpoint(tiny_fp32, tmp_path):
    assert startup.is_beam_launch({"reasoning_parser": "beam"})
    assert startup.is_beam_launch({"tool_call_parser": "beam"})
    assert startup.is_beam_launch({"load_format": "beam"})
    assert startup.is_beam_launch({"model": str(tiny_fp32)})  # config.json says model_type beam
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert not startup.is_beam_launch({"model": str(tmp_path)})
    assert not startup.is_beam_launch({"model": "no/such-model-anywhere"})


def test_serve_guard_refuses_only_beam_launches(monkeypatch, tmp_path):
    monkeypatch.delenv("PT_HPU_SDPA_QKV_SLICE_MODE_FWD", raising=False)
    bad = SimpleNamespace(model="x", reasoning_parser="beam", tool_call_parser="hermes",
                          chat_template_content_format="openai", max_model_len=4096)
    with pytest.raises(StartupError) as e:
        startup.guard_serve_args(bad)
    assert "--tool-call-parser hermes" in str(e.value) and "--chat-template-content-format openai" in str(e.value)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    other = SimpleNamespace(model=str(tmp_path), tool_call_parser="hermes", chat_template_content_format="openai")
    startup.guard_serve_args(other)  # not a Beam launch: not ours to refuse


def test_engine_guard_uses_the_resolved_model_type(monkeypatch):
    monkeypatch.setenv("PT_HPU_SDPA_QKV_SLICE_MODE_FWD", "1")
    args = SimpleNamespace(model="some/hub-id", max_model_len=4096)
    beam = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="beam")))
    llama = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="llama")))
    with pytest.raises(StartupError, match="PT_HPU_SDPA_QKV_SLICE_MODE_FWD"):
        startup.guard_engine_config(args, beam)
    startup.guard_engine_config(args, llama)


def test_install_wraps_once_and_only_imported_modules(monkeypatch):
    calls = []

    class ServeSubcommand:
        def validate(self, args):
            calls.append(("validate", args))

    class EngineArgs:
        def create_engine_config(self, usage_context=None):
            calls.append(("config", usage_context))
            return SimpleNamespace(model_config=None)

    monkeypatch.setitem(sys.modules, "vllm.entrypoints.cli.serve", types.SimpleNamespace(ServeSubcommand=ServeSubcommand))
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", types.SimpleNamespace(EngineArgs=EngineArgs))
    seen = []
    monkeypatch.setattr(startup, "guard_serve_args", lambda args: seen.append(args))
    startup.install()
    startup.install()  # idempotent: one wrap
    ServeSubcommand().validate("ARGS")
    assert seen == ["ARGS"] and calls == [("validate", "ARGS")]
    engine_args = EngineArgs()
    engine_args.model, engine_args.max_model_len = "x", 1
    assert engine_args.create_engine_config(usage_context="ctx").model_config is None
    assert calls[-1] == ("config", "ctx")


@pytest.mark.slow
def test_vllm_serve_refuses_a_forbidden_launch(tiny_fp32):
    """A real `vllm serve` of a tiny Beam with the recipe's "What not to do" flags: it must exit
    non-zero before the engine starts, naming both culprits."""
    from beam_hpu.cli import serve_command, serve_env

    cmd = serve_command(tiny_fp32, port=1, extra=["--chat-template-content-format", "openai",
                                                  "--tool-call-parser", "hermes"])
    env = serve_env(1)
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "the Beam port refuses to start" in out, out[-3000:]
    assert "--chat-template-content-format openai" in out and "--tool-call-parser hermes" in out
    assert "Starting vLLM server" not in out and "EngineCore" not in out


@pytest.mark.slow
def test_engine_start_refuses_a_forbidden_environment(tiny_fp32):
    """The engine-side hook: `LLM(...)` of a tiny Beam with PT_HPU_SDPA_QKV_SLICE_MODE_FWD set."""
    script = ("from vllm import LLM\n"
              "if __name__ == '__main__':\n"
              f"    LLM(model={str(tiny_fp32)!r}, max_model_len=1024, enforce_eager=True)\n")
    env = cpu_env(1)
    env["PT_HPU_SDPA_QKV_SLICE_MODE_FWD"] = "1"
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "PT_HPU_SDPA_QKV_SLICE_MODE_FWD is set" in out, out[-3000:]
