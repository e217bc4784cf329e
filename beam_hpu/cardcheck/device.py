"""Where card-check measures: the Gaudi card when habana_frameworks is importable and a card is
present, else this host's CPU with the project's stand-ins (every figure then labelled as not a
card measurement). Timing is the median of repeated calls after a warm-up, synchronised.

On a card the premise rows run as the server runs its steps: in lazy mode (PT_HPU_LAZY_MODE=1, set
before the bridge loads unless the caller chose otherwise) and, for a call whose tensors are the
same at every repeat, replayed from an HPU graph captured on the warm-up (the bridge's
wrap_in_hpu_graph, as vllm-gaudi's runner wraps its model, disable_tensor_cache as there)."""

from __future__ import annotations

import os
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

    def median_ms(self, fn: Callable[[], object], repeats: int, warmup: int = 2, graph: bool = True) -> float:
        """`graph`: on a card, capture fn's work in an HPU graph on the warm-up and time its replays
        (False for a call that takes other inputs at each repeat, or host work)."""
        if graph and self.on_card:
            fn = self._graphed(fn)
            warmup = max(warmup, 1)  # the first call captures
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

    @staticmethod
    def _graphed(fn: Callable[[], object]) -> Callable[[], object]:
        import habana_frameworks.torch as htorch

        class Call(torch.nn.Module):
            def forward(self):
                return fn()

        return htorch.hpu.wrap_in_hpu_graph(Call(), disable_tensor_cache=True)

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
        # The server decodes in lazy mode (serving/launch.sh); the bridge reads this when it loads.
        os.environ.setdefault("PT_HPU_LAZY_MODE", "1")
        try:
            import habana_frameworks.torch.core  # noqa: F401

            if torch.hpu.is_available():
                return Device("hpu", CARD_LABEL)
        except (ImportError, AttributeError, RuntimeError):
            pass
    return Device("cpu", CPU_LABEL)
