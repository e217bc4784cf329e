"""benchmarks/measured_bounds.py: the verdict of a lower bound timed beside what it bounds. A
ratio under 1 is a measurement fault, never a result; medians over interleaved rounds."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "measured_bounds", Path(__file__).resolve().parents[2] / "benchmarks" / "measured_bounds.py")
mb = sys.modules.setdefault("measured_bounds", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(mb)  # registered first: its dataclasses look their module up


def test_every_measurement_leads_a_round_in_turn():
    orders = [mb.rotated(["read", "layer", "arith"], r) for r in range(3)]
    assert orders == [["read", "layer", "arith"], ["layer", "arith", "read"], ["arith", "read", "layer"]]
    assert {o[0] for o in orders} == {"read", "layer", "arith"}


def test_the_ratio_is_of_medians_against_the_largest_bound():
    layer = mb.Timing("layer", (10.0, 30.0, 12.0))  # one slow round: the median ignores it
    read, arith = mb.Timing("read", (2.0, 2.0, 9.0)), mb.Timing("arith", (5.0, 6.0, 4.0))
    v = mb.verdict(layer, [read, arith])
    assert (v.ratio, v.bound, v.fault) == (12.0 / 5.0, "arith", False)
    assert v.round_ratios == (2.0, 5.0, 12.0 / 9.0)
    assert "NOT met" in v.text(2) and "met" in mb.verdict(layer, [read]).text(10)
    assert "per round 1.33-5.00, 0 of 3 under 1" in v.text(2)
    noisy = mb.verdict(layer, [mb.Timing("arith", (11.0, 6.0, 4.0))])  # round 1 alone under 1
    assert not noisy.fault and "1 of 3 under 1" in noisy.text(2)
    assert layer.text() == "12.0 s [10.0-30.0 over 3]"


def test_a_bound_above_what_it_bounds_is_a_fault_not_a_result():
    # README's old dense row: the layer 129.7 s, its arithmetic alone (measured once, later) 210.5 s
    v = mb.verdict(mb.Timing("layer", (129.7,)), [mb.Timing("read", (1.5,)), mb.Timing("arith", (210.5,))])
    assert v.fault and v.ratio == pytest.approx(0.62, abs=0.005)
    assert v.text(2).startswith("MEASUREMENT FAULT") and "no result" in v.text(2) and "met" not in v.text(2)
    assert not mb.verdict(mb.Timing("layer", (5.0,)), [mb.Timing("arith", (5.0,))]).fault  # equal: a bound


def test_an_unmeasured_bound_is_left_out_and_none_is_an_error():
    layer = mb.Timing("layer", (4.0, 4.0))
    v = mb.verdict(layer, [mb.Timing("read", (1.0, 1.0)), mb.Timing("arith", (math.nan, math.nan))])
    assert v.bound == "read" and v.ratio == 4.0
    with pytest.raises(ValueError, match="no bound of layer"):
        mb.verdict(layer, [mb.Timing("arith", (math.nan, math.nan))])
    with pytest.raises(ValueError, match="one timing per round"):
        mb.verdict(layer, [mb.Timing("read", (1.0,))])
