"""Where card-check measures: the Gaudi card when habana_frameworks is importable and a card is
present, else this host's CPU with the project's stand-ins (every figure then labelled as not a
card measurement). Timing is the median of repeated calls after a warm-up, synchronised."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

CPU_LABEL = "CPU stand-ins: not a card measurement"
CARD_LABEL = "Gaudi card measurement"


@dataclass
class Device:
    name: str  # "hpu" or "cpu"
    label: str

    @property
    def on_card(self) -> bool:
        return self.name == "hpu"

    def sync(self) -> None:
        if self.on_card:
            import habana_frameworks.torch.core as htcore

            htcore.mark_step()
            torch.hpu.synchronize()

    def median_ms(self, fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    def graph_compilations(self) -> int | None:
        """The bridge's count of graph compilations so far, or None where there is no card."""
        if not self.on_card:
            return None
        try:  # the bridge's metrics API: [(name, value), ...] with TotalNumber first
            from habana_frameworks.torch.hpu.metrics import metric_global

            return int(metric_global("graph_compilation").stats()[0][1])
        except Exception:  # an API this image does not have: the figure is reported unknown
            return None


def detect(force_cpu: bool = False) -> Device:
    if not force_cpu:
        try:
            import habana_frameworks.torch.core  # noqa: F401

            if torch.hpu.is_available():
                return Device("hpu", CARD_LABEL)
        except (ImportError, AttributeError, RuntimeError):
            pass
    return Device("cpu", CPU_LABEL)
