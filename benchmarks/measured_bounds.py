"""Lower bounds timed beside what they bound: interleaved rounds, medians, spread, a verdict.

A lower bound of a step (the raw read of its bytes, its arithmetic alone) is only a bound when it
is measured under the same conditions as the step. So each round times the step and each of its
bounds back to back, in an order that rotates from round to round (drift of the host's load then
falls on all of them alike), and the verdict compares medians over the rounds. The ratio
step / max(bounds) is at least 1 for a true lower bound; a ratio under 1 says the measurement is at
fault (load, cache state, noise), not that the step beat its own bound, and is reported so, never
as a result.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


def rotated(names: list[str], round_index: int) -> list[str]:
    """The order of the measurements in round `round_index`: `names` rotated by the round."""
    k = round_index % len(names)
    return names[k:] + names[:k]


@dataclass(frozen=True)
class Timing:
    """One quantity's seconds over the rounds."""
    name: str
    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def text(self) -> str:
        """`median s [min-max over n]`."""
        lo, hi = min(self.seconds), max(self.seconds)
        return f"{self.median:.1f} s [{lo:.1f}-{hi:.1f} over {len(self.seconds)}]"


@dataclass(frozen=True)
class Verdict:
    ratio: float  # median(step) / max(median(bound))
    bound: str  # the largest bound's name
    round_ratios: tuple[float, ...]  # the same ratio within each round
    fault: bool  # a ratio under 1: the bound measured above what it bounds

    def text(self, target: float) -> str:
        under = sum(r < 1 for r in self.round_ratios)
        spread = (f"per round {min(self.round_ratios):.2f}-{max(self.round_ratios):.2f}, "
                  f"{under} of {len(self.round_ratios)} under 1")
        if self.fault:
            return (f"MEASUREMENT FAULT: ratio {self.ratio:.2f} < 1 ({self.bound} measured above the layer that "
                    f"contains it; {spread}): no result")
        met = "met" if self.ratio <= target else "NOT met"
        return f"ratio {self.ratio:.2f} (bound: {self.bound}; {spread}; target <= {target:g}: {met})"


def verdict(step: Timing, bounds: list[Timing]) -> Verdict:
    """The step against its largest bound, by medians; bounds not measured (NaN) are left out."""
    measured = [b for b in bounds if not any(math.isnan(s) for s in b.seconds)]
    if not measured:
        raise ValueError(f"no bound of {step.name} was measured")
    if any(len(b.seconds) != len(step.seconds) for b in measured):
        raise ValueError(f"{step.name}: every bound needs one timing per round ({len(step.seconds)})")
    largest = max(measured, key=lambda b: b.median)
    ratio = step.median / largest.median
    per_round = tuple(s / max(b.seconds[r] for b in measured) for r, s in enumerate(step.seconds))
    return Verdict(ratio, largest.name, per_round, ratio < 1)
