"""benchmarks/decode_model.py: the step-time model's byte counts follow Beam's shapes, it reproduces
the two measured figures it is calibrated on, and it prints the per-batch table."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "decode_model", Path(__file__).resolve().parents[2] / "benchmarks" / "decode_model.py")
dm = sys.modules.setdefault("decode_model", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(dm)


def test_expert_bytes_are_the_issues_figures():
    s = dm.Shapes.published()
    assert s.expert_bytes == 3 * 2560 * 5120 == 39_321_600  # w13 [2 x 2560, 5120] + w2 [5120, 2560]
    assert s.local_experts == 32 and s.moe_layers == 49
    assert round(dm.expert_bytes(s, 1, "stock") / 1e9, 1) == 61.7
    # G = 8 at T = 1: a quarter of the card's experts, three reads of them with the copy.
    assert dm.expert_bytes(s, 1, "gathered-fused") * 4 == dm.expert_bytes(s, 1, "stock")
    assert dm.expert_bytes(s, 1, "gathered-copy") == 3 * dm.expert_bytes(s, 1, "gathered-fused")
    assert dm.expert_bytes(s, 4, "gathered-fused") == dm.expert_bytes(s, 4, "stock")  # G = 32


def test_kv_grows_with_sequences_and_context():
    s = dm.Shapes.published()
    assert dm.kv_bytes(s, 16, 1024) == 16 * dm.kv_bytes(s, 1, 1024)
    # Sliding layers stop at the window's blocks; full layers keep growing.
    grow = dm.kv_bytes(s, 1, 8192) - dm.kv_bytes(s, 1, 4096)
    assert grow == 9 * 4096 * 2 * 128 * 2


def test_the_table_reproduces_the_calibration_and_prints_every_batch(capsys):
    dm.main([])
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.strip()[:1].isdigit() and "|" in line]
    keys = [tuple(int(v) for v in r[0].split()[:2]) for r in rows]  # (batch, k)
    assert keys == [(b, k) for k in (0, 4) for b in dm.BATCHES]
    stock = {key: float(r[3].split()[0]) for key, r in zip(keys, rows)}
    assert stock[(1, 0)] == 29.0 and stock[(16, 0)] == 410.0  # the measured figures it is fitted to
    assert "MODEL, not a measurement" in out and "The card measurement" in out


def _dflash2_table(out: str) -> dict[float, tuple[float, float]]:
    """L -> (gain, tok/s) from the DFlash2 table's rows."""
    start = out.index("DFlash2 at one stream")
    rows = [line.split() for line in out[start:].splitlines() if "=" in line and line.split()[0][:1].isdigit()]
    return {float(r[0]): (float(r[6].rstrip("x")), float(r[7])) for r in rows}


def test_the_dflash2_figure_prints_its_inputs_and_the_plans_arithmetic(capsys):
    dm.main([])
    out = capsys.readouterr().out
    assert "DFlash2 at one stream: MODEL, not a measurement" in out
    for text in ("verify(8)/verify(1) = 1.000: assumed", "block/verify(1) = 0.100: assumed",
                 "mean accepted length L = 2.5 / 3.5 / 4: assumed", "card-check's verify_rows row",
                 "card-check's dflash2_block row", "benchmarks/spec_decode.py --spec dflash2"):
        assert text in out, text
    table = _dflash2_table(out)
    assert set(table) == {2.5, 3.5, 4.0}
    for length, (gain, tok_s) in table.items():  # L / 1.1, times the recipe's 29 tok/s midpoint
        assert gain == round(length / 1.1, 2) and tok_s == round(29.0 * length / 1.1, 1)


def test_the_dflash2_figure_takes_given_inputs():
    rows = dm.dflash2_rows(1.5, 0.5, (3.0,), 30.0)
    assert rows == [{"accepted": 3.0, "cost": 2.0, "gain": 1.5, "tok_s": 45.0}]


def test_the_dflash2_figure_reads_a_card_check_report(tmp_path, capsys):
    """The two costs come from the report's verify_rows and dflash2 rows, labelled with its device."""
    report = {"label": "Gaudi card measurement", "verdicts": [
        {"premise": "verify_rows", "figures": {"ms_by_rows": {"1": 30.0, "8": 36.0},
                                               "ratio_to_1_row": {"1": 1.0, "8": 1.2}, "stand_in": "S"}},
        {"premise": "dflash2_block", "figures": {"ms_by_batch": {"1": 6.0}, "shard": "X"}},
        {"premise": "dflash2", "figures": {"block_over_verify_1": 0.2}}]}
    path = tmp_path / "card-check.json"
    path.write_text(json.dumps(report))
    got = dm.dflash2_costs_from_card_check(path)
    assert (got["verify8"], got["block"], got["rows"]) == (1.2, 0.2, 8)
    dm.main(["--card-check", str(path), "--dflash2-accepted", "2.8"])
    out = capsys.readouterr().out
    assert "verify(8)/verify(1) = 1.200: card-check" in out and "[Gaudi card measurement]" in out
    assert "NOTE" not in out[out.index("DFlash2 at one stream"):]
    assert _dflash2_table(out) == {2.8: (2.0, 58.0)}
