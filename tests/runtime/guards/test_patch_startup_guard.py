"""The runtime patch `startup-guard` (beam_hpu/runtime/guards/patch_startup_guard.py): the port's launch guards
where vLLM calls them, `vllm serve`'s argument validation and every engine start."""

from __future__ import annotations

import subprocess
import sys
import types
from types import SimpleNamespace

import pytest

from beam_hpu.runtime.guards import patch_startup_guard as startup
from tests.support.engines import REPO, cpu_env


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


def serve_refused(model_dir, extra) -> str:
    """A real `vllm serve` of `model_dir` with `extra` flags, which must exit non-zero before the
    engine starts, with the port's refusal; what it printed."""
    from beam_hpu.demo.serve import serve_command, serve_env

    env = serve_env(1)
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(serve_command(model_dir, port=1, extra=extra), env=env, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "the Beam port refuses to start" in out, out[-3000:]
    assert "Starting vLLM server" not in out and "EngineCore" not in out
    return out


@pytest.mark.slow
def test_vllm_serve_refuses_a_forbidden_launch(tiny_fp32):
    """A real `vllm serve` of a tiny Beam with the recipe's "What not to do" flags: it must exit
    non-zero before the engine starts, naming both culprits."""
    out = serve_refused(tiny_fp32, ["--chat-template-content-format", "openai", "--tool-call-parser", "hermes"])
    assert "--chat-template-content-format openai" in out and "--tool-call-parser hermes" in out


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


@pytest.mark.slow
def test_vllm_serve_refuses_an_option_the_dflash2_path_does_not_read():
    """A real `vllm serve` of the tiny trained Beam with its DFlash2 drafter and
    `use_local_argmax_reduction: true` (EAGLE's draft sampling reads it; the DFlash2 walk does not):
    vLLM's own SpeculativeConfig takes the key, so only the port's guard stops it; it must exit
    before the engine starts, naming it."""
    import json

    from beam_hpu.tiny.checkpoint import TRAINED_DIR
    from beam_hpu.tiny.dflash2_drafter import speculative_config

    config = {**json.loads(speculative_config()), "use_local_argmax_reduction": True}
    out = serve_refused(TRAINED_DIR, ["--speculative-config", json.dumps(config)])
    assert "--speculative-config use_local_argmax_reduction True with Beam's DFlash2 drafter" in out
