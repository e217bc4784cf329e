"""BEAM_PREFILL_INFLIGHT: running decodes stay in flight while a long prompt prefills.

Facts this rests on (vLLM 0.30.0 `vllm/v1/core/sched/scheduler.py`, first-come-first-served):
- `Scheduler.schedule` walks `self.running` in list order, giving each request
  `min(tokens it wants, token budget left)`. A prompt being prefilled in chunks wants all of its
  remaining tokens, so whatever stands after it in the list gets the budget it leaves over, which
  for a 250K prompt and a 4,096-token budget is nothing, chunk after chunk.
- When a request cannot get KV blocks, the scheduler preempts `self.running[-1]` (frees its blocks,
  back to the waiting queue, recomputed later) and repeats until the allocation fits or the
  request has preempted itself. A prompt that was admitted before some decodes therefore evicts
  those decodes, newest first, to grow.
- `self.running` is in admission order: a request admitted (or resumed after a preemption) while
  the prompt prefills stands behind it.
- vllm-gaudi's runner executes whatever a step carries: the step's prefills one by one, then one
  batch of its decodes. Whether a decode advances in a step with a prefill chunk is decided by the
  scheduler alone, so the policy belongs there, on HPU and CPU alike.

The policy with 1: before each step, the running requests are put in the order decodes first,
then requests still prefilling, each group in its own order. The stock walk then gives every
running decode its token before any prefill chunk takes the rest of the budget, and the stock
preemption, which takes from the end, frees a prefilling request (the newest first; a prompt that
cannot grow frees itself and waits for blocks in the waiting queue) before it would free a decode.
A decode is preempted only when no prefilling request is left to free, as among decodes in stock
vLLM. With 0 the order is left as vLLM keeps it. Under the priority policy vLLM picks victims by
priority, not by order: there only the first half (decodes get their tokens first) holds.

Plain functions only: no vLLM or torch import; the runtime patch `prefill-inflight`
(beam_hpu/runtime/prefill/patch_inflight.py) calls them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

R = TypeVar("R")


def decodes_first(running: Sequence[R], is_prefilling: Callable[[R], bool]) -> list[R]:
    """`running` with every decoding request before every prefilling one, each group in its order."""
    decodes = [r for r in running if not is_prefilling(r)]
    prefills = [r for r in running if is_prefilling(r)]
    return decodes + prefills


def is_prefilling(request) -> bool:
    """Whether a running vLLM request's next step is (part of) a prefill: its prompt, or a resumed
    request recomputing its tokens. vLLM's own flag, set after every step that schedules it."""
    return bool(request.is_prefill_chunk)
