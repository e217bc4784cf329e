"""tests/build_gates.py as CI runs it on the CPU tree (the gates that need a vllm-gaudi tree skip
with the reason; install.sh's test runs all eight against one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def gates(*args: str, env_extra=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", PYTHONPATH=str(REPO))  # this checkout's beam_hpu
    for name in [n for n in env if n.startswith(("BEAM_", "VLLM_BEAM_"))]:
        env.pop(name)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, str(REPO / "tests/build_gates.py"), *args], env=env,
                          capture_output=True, text=True, timeout=600, cwd=REPO)


def lines(proc) -> list[str]:
    return [line for line in proc.stdout.splitlines() if line.startswith("gate ")]


def test_build_gates_on_the_cpu_tree():
    proc = gates()
    got = lines(proc)
    assert [g.split(":")[0] for g in got] == [
        "gate 1 fix profile applied", "gate 2 port patches applied", "gate 3 plugin registered",
        "gate 4 vLLM registrations", "gate 5 BeamConfig", "gate 6 template and parsers", "gate 7 switches",
        "gate 8 bucket file"], proc.stdout + proc.stderr[-3000:]
    for line in got[:2]:  # no vllm-gaudi on the CPU tree: skipped, saying why
        assert ": SKIP: no vllm-gaudi tree here" in line
    failed = [g for g in got if ": FAIL: " in g]
    assert proc.returncode == 0 and not failed, proc.stdout


def test_build_gates_fail_and_say_why(tmp_path):
    proc = gates("--cookbook", str(tmp_path), env_extra={"BEAM_GRAMMAR_DEVICE_MASK": "maybe"})
    got = {g.split(":")[0]: g for g in lines(proc)}
    assert proc.returncode == 1
    assert "FAIL" in got["gate 7 switches"] and "BEAM_GRAMMAR_DEVICE_MASK='maybe'" in got["gate 7 switches"]
    assert "FAIL" in got["gate 8 bucket file"] and "does not exist" in got["gate 8 bucket file"]
    assert proc.stdout.rstrip().splitlines()[-1].startswith("build gates: ")


def test_build_gate_refuses_a_speculative_variant_file_over_the_graph_limit(tmp_path):
    """The speculative variant's file replaced by the recipe's: 69 decode graphs at 4 drafts, over the
    limit; the DFlash2 variant's by the speculative one's: 28 graphs with the drafter's."""
    serving = tmp_path / "ports/beam-1-0/serving"
    serving.mkdir(parents=True)
    recipe_file = (REPO / "serving/tp8-seqs16-256k.txt").read_text()
    (serving / "tp8-seqs16-256k.txt").write_text(recipe_file)
    (serving / "tp8-seqs16-256k-spec.txt").write_text(recipe_file)
    got = {g.split(":")[0]: g for g in lines(gates("--cookbook", str(tmp_path)))}
    line = got["gate 8 bucket file"]
    assert "FAIL" in line and "tp8-seqs16-256k-spec.txt" in line and "limit is 25" in line, line
    (serving / "tp8-seqs16-256k-spec.txt").write_text((REPO / "serving/tp8-seqs16-256k-spec.txt").read_text())
    # the DFlash2 variant's file replaced by the speculative one: 24 + 4 drafter graphs at 7 drafts
    (serving / "tp8-seqs16-256k-dflash2.txt").write_text((REPO / "serving/tp8-seqs16-256k-spec.txt").read_text())
    line = {g.split(":")[0]: g for g in lines(gates("--cookbook", str(tmp_path)))}["gate 8 bucket file"]
    assert "FAIL" in line and "tp8-seqs16-256k-dflash2.txt" in line and "28 graphs; the limit is 25" in line, line
    (serving / "tp8-seqs16-256k-dflash2.txt").write_text((REPO / "serving/tp8-seqs16-256k-dflash2.txt").read_text())
    got = {g.split(":")[0]: g for g in lines(gates("--cookbook", str(tmp_path)))}
    assert ": PASS: " in got["gate 8 bucket file"] and "speculative variant, 4 drafts" in got["gate 8 bucket file"], got
    assert "tp8-seqs16-256k-dflash2.txt (dflash2 variant, 7 drafts)" in got["gate 8 bucket file"], got
