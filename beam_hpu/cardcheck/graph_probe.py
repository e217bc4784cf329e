"""What a decode step costs the host on a Gaudi node, read inside vLLM's workers: graph pieces
launched, host dispatch time, graph compilations and the device memory the step's graphs keep.

card-check's engine (engine_run.py) starts vLLM with `worker_extension_cls` set to `GraphProbe`, so
every worker (the 8 of TP 8 are other processes) gains two methods the engine calls by name through
`LLM.collective_rpc`: `beam_probe_start` opens a window, `beam_probe_read` closes it and returns
what the worker saw in it. The counts come from the bridge's own event dispatcher
(habana_frameworks.torch.utils.event_dispatcher, python_packages/.../event_dispatcher/csrc/
bindings.cpp in HabanaAI/gaudi-pytorch-bridge):

- MARK_STEP is published by every host step marker (`HbLazyTensor::StepMarkerBind`,
  habana_lazy/hpu_lazy_tensors.cpp): in lazy mode each one cuts and launches a graph piece, so
  the markers inside one `execute_model` call are the pieces its forward launches. vllm-gaudi's
  `modify_model_layers` adds one after every VLLM_CONFIG_HIDDEN_LAYERS-th decoder layer. A step
  replayed from an HPU graph runs no Python hooks: its markers are the runner's own, and the
  pieces show on the step that captured the graph (the window's first run).
- GRAPH_COMPILATION is published per compiled recipe (the bridge's graph_compilation metric counts
  the same events).
- Host dispatch per step: from `execute_model`'s call to the last marker inside it (when the host
  has handed every piece to the device); the call's whole time beside it.
- Memory: torch.hpu.memory_allocated() at the window's ends (what the captured graphs keep) and
  the peak inside it.

Where the worker has no Habana bridge (vLLM-CPU), reading returns {"available": False, "why": ...}:
nothing here estimates a card's figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Window:
    calls: list[dict] = field(default_factory=list)  # per execute_model: start, end, marker times
    compilations: int = 0
    memory_start: int | None = None


def _bridge():
    """(EventDispatcher, EventId) of the Habana bridge in this process, or None."""
    try:
        from habana_frameworks.torch.utils.event_dispatcher import EventDispatcher, EventId
    except ImportError:
        return None
    return EventDispatcher, EventId


class GraphProbe:
    """Mixed into vLLM's worker class (vLLM's `worker_extension_cls`): methods named so that they
    cannot collide with a worker's own."""

    def beam_probe_start(self) -> bool:
        """Open a window; False where this worker has no Habana bridge."""
        bridge = _bridge()
        if bridge is None:
            return False
        dispatcher, event_id = bridge
        if not hasattr(self, "_beam_probe"):
            self._beam_probe_subscribe(dispatcher, event_id)
        import torch

        self._beam_probe = Window(memory_start=int(torch.hpu.memory_allocated()))
        torch.hpu.reset_peak_memory_stats()
        return True

    def _beam_probe_subscribe(self, dispatcher, event_id) -> None:
        def on_mark_step(timestamp, params):
            calls = self._beam_probe.calls
            if calls and calls[-1]["end"] is None:
                calls[-1]["markers"].append(time.perf_counter())

        def on_compile(timestamp, params):
            self._beam_probe.compilations += 1

        instance = dispatcher.instance()
        # the handles are kept: the dispatcher calls a callback while its handle lives
        self._beam_probe_handles = [instance.subscribe(event_id.MARK_STEP, on_mark_step),
                                    instance.subscribe(event_id.GRAPH_COMPILATION, on_compile)]
        execute = self.execute_model

        def timed_execute(*args, **kwargs):
            call = {"start": time.perf_counter(), "end": None, "markers": []}
            self._beam_probe.calls.append(call)
            try:
                return execute(*args, **kwargs)
            finally:
                call["end"] = time.perf_counter()

        self.execute_model = timed_execute

    def beam_probe_read(self) -> dict:
        """The window's figures: per execute_model call its markers (graph pieces), host dispatch
        and call time (ms); compilations; memory at the ends and the peak (bytes)."""
        if _bridge() is None or not hasattr(self, "_beam_probe"):
            return {"available": False, "why": "no Habana bridge in this worker: not a card"}
        import torch

        window = self._beam_probe
        calls = [c for c in window.calls if c["end"] is not None]
        return {
            "available": True,
            "markers": [len(c["markers"]) for c in calls],
            "dispatch_ms": [(c["markers"][-1] - c["start"]) * 1e3 if c["markers"] else None for c in calls],
            "call_ms": [(c["end"] - c["start"]) * 1e3 for c in calls],
            "compilations": window.compilations,
            "memory_start": window.memory_start,
            "memory_end": int(torch.hpu.memory_allocated()),
            "memory_peak": int(torch.hpu.max_memory_allocated()),
        }


EXTENSION = f"{GraphProbe.__module__}.{GraphProbe.__qualname__}"


def summarise(first: list[dict], measured: list[dict]) -> dict:
    """One batch's node-level figures from every worker's window over its first (capturing,
    compiling) run and its measured run: the worst worker's (a TP step waits for the slowest).
    {"available": False, ...} as the workers said where none has a bridge."""
    if not all(w.get("available") for w in first + measured):
        return {"available": False, "why": next(w["why"] for w in first + measured if not w.get("available"))}

    def median(values):
        values = sorted(v for v in values if v is not None)
        return values[len(values) // 2] if values else None

    return {
        "available": True,
        # the capturing forward runs every hook: its markers are the pieces one step launches
        "graph_pieces": max(max(w["markers"], default=0) for w in first),
        "markers_per_step": max(median(w["markers"]) or 0 for w in measured),
        "dispatch_ms": max(median(w["dispatch_ms"]) or 0.0 for w in measured),
        "execute_ms": max(median(w["call_ms"]) or 0.0 for w in measured),
        "compilations": max(w["compilations"] for w in first),
        "recompilations": max(w["compilations"] for w in measured),
        "graph_memory_mib": max(w["memory_end"] - w["memory_start"] for w in first) / 2**20,
        "peak_memory_mib": max(w["memory_peak"] for w in first + measured) / 2**20,
    }
