"""Runtime patch `cpu-eagle-step`: vLLM-CPU's EAGLE/EAGLE3 proposer advances its drafting steps
through `beam_hpu.runtime.speculative.cpu_eagle_step` instead of a Triton dispatcher it cannot launch. CPU only."""

from __future__ import annotations

import inspect

from beam_hpu.runtime.wrap import wrap

NAME = "cpu-eagle-step"


def _advance_on_cpu(stock):
    from beam_hpu.runtime.speculative.cpu_eagle_step import advance_one_position
    from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

    signature = inspect.signature(stock)

    def eagle_step_update_slot_mapping_and_metadata(*args, **kwargs):
        a = signature.bind(*args, **kwargs)
        a.apply_defaults()
        return advance_one_position(**a.arguments, padding_slot=PADDING_SLOT_ID)

    return eagle_step_update_slot_mapping_and_metadata


def install() -> None:
    # The proposer imported the function by name: its own module's binding is the one it calls.
    from vllm.v1.spec_decode import llm_base_proposer

    wrap(llm_base_proposer, "eagle_step_update_slot_mapping_and_metadata", _advance_on_cpu, patch=NAME)
