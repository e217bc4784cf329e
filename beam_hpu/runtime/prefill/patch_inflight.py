"""Runtime patch `prefill-inflight`: with BEAM_PREFILL_INFLIGHT=1, the scheduler of an engine serving
Beam sees its running requests decodes first before every step (beam_hpu.runtime.prefill.inflight says
what that buys and why it is enough). Any platform: vllm-gaudi's HPU scheduler calls this
`schedule` through super(). Another model's scheduler keeps vLLM's order whatever the switch says."""

from __future__ import annotations

from beam_hpu.runtime.wrap import wrap

NAME = "prefill-inflight"


def _schedule_decodes_first(stock_schedule):
    from beam_hpu.runtime.prefill.inflight import decodes_first, is_prefilling
    from beam_hpu.scope import serves_beam
    from beam_hpu.settings import switches

    def schedule(self, *args, **kwargs):
        # Read per step: 0 must leave vLLM's order untouched, and tests flip it within a process.
        if serves_beam(self.vllm_config) and switches.current("BEAM_PREFILL_INFLIGHT"):
            self.running[:] = decodes_first(self.running, is_prefilling)
        return stock_schedule(self, *args, **kwargs)

    return schedule


def install() -> None:
    from vllm.v1.core.sched import scheduler

    wrap(scheduler.Scheduler, "schedule", _schedule_decodes_first, patch=NAME)
