"""benchmarks/decode_model.py: the step-time model's byte counts follow Beam's shapes, it reproduces
the two measured figures it is calibrated on, and it prints the per-batch table."""

from __future__ import annotations

import importlib.util
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
