"""Stand-ins for the Habana bridge's event dispatcher and host step marker, after its public source
(HabanaAI/gaudi-pytorch-bridge):

- `python_packages/habana_frameworks/torch/utils/event_dispatcher/csrc/bindings.cpp`: the module
  `habana_frameworks.torch.utils.event_dispatcher` exposes `EventDispatcher.instance()` with
  `subscribe(topic, callback) -> handle`, `unsubscribe(handle)` and `publish(topic, params)`, and the
  `EventId` enum (GRAPH_COMPILATION, MARK_STEP, ...); a callback is called as
  `callback(timestamp, params)` (`metrics/metrics.py`'s GraphCompilationMetric subscribes so).
- `habana_lazy/hpu_lazy_tensors.cpp`, `HbLazyTensor::StepMarkerBind`: every host step marker
  (`htcore.mark_step()`) emits MARK_STEP before it cuts the lazy graph.
- `python_packages/habana_frameworks/torch/hpu/memory.py`: `torch.hpu.memory_allocated()`,
  `max_memory_allocated()`, `reset_peak_memory_stats()`; here they report what a test sets in
  `MEMORY` (no device memory exists on CPU).
"""
from __future__ import annotations

import enum
import sys
import time
import types
from types import SimpleNamespace


class EventId(enum.Enum):
    GRAPH_COMPILATION = 0
    CPU_FALLBACK = 1
    MEMORY_DEFRAGMENTATION = 2
    MARK_STEP = 3
    PROCESS_EXIT = 4
    DEVICE_ACQUIRED = 5
    CUSTOM_EVENT = 6


class EventDispatcher:
    _instance: "EventDispatcher | None" = None

    def __init__(self):
        self._subscribers: dict[object, tuple[EventId, object]] = {}

    @classmethod
    def instance(cls) -> "EventDispatcher":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def subscribe(self, topic: EventId, callback):
        handle = object()
        self._subscribers[handle] = (topic, callback)
        return handle

    def unsubscribe(self, handle) -> None:
        self._subscribers.pop(handle, None)

    def publish(self, topic: EventId, params=()) -> None:
        stamp = time.time()
        for subscribed, callback in list(self._subscribers.values()):
            if subscribed is topic:
                callback(stamp, list(params))


def mark_step(device_str: str = "", sync: bool = False) -> None:
    EventDispatcher.instance().publish(EventId.MARK_STEP)


MEMORY = {"allocated": 0, "peak": 0}


def install():
    """The dispatcher module in sys.modules and the memory calls on torch.hpu; returns the
    `habana_frameworks.torch` namespace a tree function reads as `htorch` (its `core.mark_step`)."""
    import torch

    module = types.ModuleType("habana_frameworks.torch.utils.event_dispatcher")
    module.EventDispatcher, module.EventId = EventDispatcher, EventId
    sys.modules[module.__name__] = module
    torch.hpu.memory_allocated = lambda device=None: MEMORY["allocated"]
    torch.hpu.max_memory_allocated = lambda device=None: MEMORY["peak"]
    torch.hpu.reset_peak_memory_stats = lambda device=None: MEMORY.update(peak=MEMORY["allocated"])
    return SimpleNamespace(core=SimpleNamespace(mark_step=mark_step))
