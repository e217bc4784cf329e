"""BEAM_PREFILL_INFLIGHT's order (beam_hpu.runtime.prefill.inflight): every decode before every
prefilling request, each group in its own order, nothing lost or added; and the flag it reads is
the one vLLM's scheduler sets on a real request after a step."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from beam_hpu.runtime.prefill.inflight import decodes_first, is_prefilling


@dataclass(frozen=True)
class Running:
    name: str
    is_prefill_chunk: bool


def test_every_mix_of_up_to_six_requests_is_split_decodes_first_in_order():
    for n in range(7):
        for kinds in itertools.product((False, True), repeat=n):
            running = [Running(f"r{i}", k) for i, k in enumerate(kinds)]
            order = decodes_first(running, is_prefilling)
            assert sorted(r.name for r in order) == sorted(r.name for r in running)
            flags = [r.is_prefill_chunk for r in order]
            assert flags == sorted(flags), flags  # no decode after a prefill
            decodes = [r for r in running if not r.is_prefill_chunk]
            prefills = [r for r in running if r.is_prefill_chunk]
            assert order == decodes + prefills  # each group keeps vLLM's (admission) order


def test_an_order_that_already_holds_is_left_as_it_is():
    running = [Running("d0", False), Running("d1", False), Running("p0", True), Running("p1", True)]
    assert decodes_first(running, is_prefilling) == running


def test_the_prompt_admitted_first_goes_behind_the_decodes_admitted_after_it():
    running = [Running("prompt", True), Running("d0", False), Running("resumed", True), Running("d1", False)]
    assert [r.name for r in decodes_first(running, is_prefilling)] == ["d0", "d1", "prompt", "resumed"]


def test_is_prefilling_reads_the_flag_vllm_sets_after_a_step():
    import inspect

    from vllm import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    # The flag is vLLM's own: a request it builds carries it, and the scheduler rewrites it after
    # every step that schedules the request. If vLLM renames or stops updating it, this fails.
    request = Request("r", prompt_token_ids=list(range(10)), sampling_params=SamplingParams(max_tokens=4),
                      pooling_params=None)
    assert request.is_prefill_chunk is False and not is_prefilling(request)
    assert "request.is_prefill_chunk = " in inspect.getsource(Scheduler._update_after_schedule)
    request.is_prefill_chunk = True
    assert is_prefilling(request)
