"""With the plugin installed, a model that is not Beam gets vLLM's own behaviour.

The plugin goes into images that may serve other models, so every runtime patch acts only for
Beam or says in its index entry why it must be global (`scope`, beam_hpu/runtime/__init__.py).
Here tiny non-Beam checkpoints written by the test (tests/support/scope_models.py) run in vLLM's
offline engine twice, once with only our plugin (`VLLM_PLUGINS=beam`) and once with general
plugins off (`VLLM_PLUGINS=`), and must come out the same:

- an FP8 Llama (compressed-tensors FP8_DYNAMIC, as Beam's checkpoint): the scheduler's steps in
  the prompt-first scenario with BEAM_PREFILL_INFLIGHT=1 (prefill-inflight), every linear's quant
  method, kernel and activation quantiser (cpu-fp8-dense-rounding), greedy tokens;
- an unquantised Qwen3-MoE: the experts' quant method (cpu-expert-parallel passes through),
  greedy tokens;
- FP8 MoE models, a Qwen3-MoE and a Qwen2-MoE with shared experts (portable-fp8-moe): refused at
  load, before any request, with vLLM's own error (`Unsupported FP8 MoE backend: NONE`), exactly as
  without the plugin; our portable experts (which have no shared-expert path) never take them.

Each run is one engine start (~30-60 s on 2 cores); each engine is started once per module.
Verdicts are token ids, class names and step counts: nothing depends on the host's speed or ISA.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.engines import REPO, offline_env

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 3, 44, 250, 17]]
PLUGINS = {"on": "beam", "off": ""}
OURS = ("prefill-inflight", "cpu-fp8-dense-rounding", "portable-fp8-moe")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.support.scope_models import write_tiny

    root = tmp_path_factory.mktemp("scope")
    made = {}

    def checkpoint(kind: str, fp8: bool) -> Path:
        key = f"{kind}{'-fp8' if fp8 else ''}"
        if key not in made:
            made[key] = write_tiny(root / key, kind, fp8=fp8)
        return made[key]

    return checkpoint


@pytest.fixture(scope="module")
def engine(checkpoints, tmp_path_factory):
    """engine(kind, fp8, plugins, schedule=False) -> (returncode, output, report or None); cached."""
    runs = {}
    work = tmp_path_factory.mktemp("runs")

    def start(kind: str, fp8: bool, plugins: str, schedule: bool = False):
        key = (kind, fp8, plugins, schedule)
        if key not in runs:
            spec_path, out_path = work / f"{len(runs)}.json", work / f"{len(runs)}.out.json"
            spec_path.write_text(json.dumps({"model": str(checkpoints(kind, fp8)), "prompts": PROMPTS,
                                             "schedule": schedule}))
            env = dict(offline_env(1), VLLM_PLUGINS=PLUGINS[plugins], BEAM_PREFILL_INFLIGHT="1")
            proc = subprocess.run([sys.executable, "-m", "tests.support.scope_engine", str(spec_path), str(out_path)],
                                  cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=600)
            report = json.loads(out_path.read_text()) if proc.returncode == 0 else None
            runs[key] = (proc.returncode, proc.stdout, report)
        return runs[key]

    return start


def served(engine, kind, fp8, plugins, schedule=False) -> dict:
    rc, output, report = engine(kind, fp8, plugins, schedule)
    assert rc == 0, output[-6000:]
    # The plugin really was on (its wraps are in place), or really off: else the comparison proves nothing.
    expected = dict.fromkeys(OURS) if plugins == "off" else {name: name for name in OURS}
    assert report["patched"] == expected, report["patched"]
    return report


def test_an_fp8_llama_is_scheduled_loaded_and_served_as_without_the_plugin(engine):
    on, off = (served(engine, "llama", True, p, schedule=True) for p in ("on", "off"))
    # The scenario is one where decodes-first would change the steps (vLLM preempts decodes for the
    # prompt, so a decode waits); for a Llama the order stays vLLM's with the switch at 1.
    assert sum(off["schedule"]["decode_preemptions"]) > 0 and off["schedule"]["max_decode_gap"] > 1, off["schedule"]
    assert on["schedule"] == off["schedule"]
    assert on["layers"] == off["layers"]
    linears = [row for row in on["layers"].values() if row[1] == "CompressedTensorsLinearMethod"]
    assert linears and all(row[3] == "QuantFP8" for row in linears), on["layers"]  # vLLM's own quantiser
    assert on["greedy"] == off["greedy"]
    assert all(len(tokens) == 12 for tokens in on["greedy"])


def test_a_qwen3_moe_is_loaded_and_served_as_without_the_plugin(engine):
    on, off = (served(engine, "qwen3_moe", False, p) for p in ("on", "off"))
    assert on["layers"] == off["layers"]
    assert any(row[1] == "UnquantizedFusedMoEMethod" for row in on["layers"].values()), on["layers"]
    assert on["greedy"] == off["greedy"]


def refusal(output: str) -> str:
    """The exception a refused engine start ends with (vLLM prefixes worker lines with [rank0]:)."""
    errors = re.findall(r"^(?:\[rank\d+\]: )?(\w+(?:Error|Exception): .+)$", output, re.M)
    assert errors, output[-4000:]
    return errors[-1]


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_an_fp8_moe_is_refused_at_load_as_without_the_plugin(engine, kind):
    """qwen2_moe has shared experts: our portable FP8 experts cannot serve those (they would raise
    NotImplementedError at the first request), so they must never take another model's layers."""
    (rc_on, out_on, _), (rc_off, out_off, _) = (engine(kind, True, p) for p in ("on", "off"))
    assert rc_on != 0 and rc_off != 0
    for output in (out_on, out_off):
        assert "SCOPE-LOADED" not in output  # refused while loading, before any request
    assert refusal(out_on) == refusal(out_off) == "ValueError: Unsupported FP8 MoE backend: NONE"
    assert "PortableFp8MoEMethod" not in out_on
