"""`beam-hpu card-check --quick --cpu` end to end on this host: every premise measured and judged,
the report written as JSON, every figure labelled as CPU stand-ins."""

import json
import subprocess
import sys
from pathlib import Path

from beam_hpu.cardcheck.device import CPU_LABEL

REPO = Path(__file__).resolve().parents[2]
PREMISES = ["moe", "cast", "storage", "fsdpa", "verify", "window_kv", "verify_rows", "dflash2_block", "dflash2"]


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
    # DFlash2's rows: a verify step at every row count 1..8 and its ratio to 1 row, the drafter's
    # block per batch (the project's drafter built as one card's shard), the gain from both.
    rows = by["verify_rows"]["figures"]
    assert sorted(int(t) for t in rows["ms_by_rows"]) == list(range(1, 9))
    assert rows["ratio_to_1_row"]["1"] == 1.0 and "stand_in" in rows
    block = by["dflash2_block"]["figures"]
    assert sorted(int(b) for b in block["ms_by_batch"]) == [1, 4] and "TP 8 shard" in block["shard"]
    gain = by["dflash2"]["figures"]
    assert set(gain) >= {"verify_8_over_1", "block_over_verify_1", "accepted", "gain", "gain_by_accepted"}
    assert by["dflash2"]["verdict"] in ("pays", "off: no gain")
    assert {v["switch"] for v in report["verdicts"][-3:]} == {"--speculative-config dflash (serving/launch-dflash2.sh)"}
    # The report feeds benchmarks/decode_model.py's DFlash2 figure, which says it is no card's.
    model = subprocess.run([sys.executable, "benchmarks/decode_model.py", "--card-check", str(out)],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    assert model.returncode == 0, model.stderr[-3000:]
    assert f"{rows['ratio_to_1_row']['8']:.3f}: card-check" in model.stdout
    assert f"NOTE: the card-check report is {CPU_LABEL}" in model.stdout
