"""`beam-hpu card-check --quick --cpu` end to end on this host: every premise measured and judged,
the report written as JSON, every figure labelled as CPU stand-ins."""

import json
import subprocess
import sys

from beam_hpu.cardcheck.device import CPU_LABEL

PREMISES = ["moe", "cast", "storage", "fsdpa", "verify", "window_kv"]


def test_quick_cpu_run_writes_a_verdict_per_premise(tmp_path):
    out = tmp_path / "card-check.json"
    proc = subprocess.run([sys.executable, "-m", "beam_hpu.cli", "card-check", "--quick", "--cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["label"] == CPU_LABEL
    assert [v["premise"] for v in report["verdicts"]] == PREMISES
    for verdict in report["verdicts"]:
        assert verdict["figures"] and verdict["verdict"]
        assert f"{verdict['switch']}: {verdict['verdict']}" in proc.stdout and CPU_LABEL in proc.stdout
    by = {v["premise"]: v for v in report["verdicts"]}
    # The CPU stand-ins answer what they are: the cast is the Gaudi-mode model itself, CPU
    # parameters report storage pointers that their views share, no compile counter exists.
    assert by["cast"]["verdict"] == "holds"
    assert by["storage"]["verdict"] == "pointers usable"
    assert by["verify"]["verdict"] == "unknown"
    # The gathered path and the dense pass compute the same thing on CPU.
    assert by["moe"]["figures"]["fp8_steps_apart"] <= 1.0
    assert all(f["calls"] > 1 for f in by["fsdpa"]["figures"].values())
