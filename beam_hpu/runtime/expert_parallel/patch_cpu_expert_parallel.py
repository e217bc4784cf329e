"""Runtime patch `cpu-expert-parallel`: vLLM-CPU's unquantised experts honour `expert_map`
through `beam_hpu.runtime.expert_parallel.cpu_expert_parallel.remap_topk_to_local`. CPU only."""

from __future__ import annotations

import inspect

from beam_hpu.runtime.wrap import wrap

NAME = "cpu-expert-parallel"


def _apply_with_expert_map(stock_apply):
    from beam_hpu.runtime.expert_parallel.cpu_expert_parallel import remap_topk_to_local

    signature = inspect.signature(stock_apply)

    def apply(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        a = call.arguments
        if a["expert_map"] is not None:
            if a["apply_router_weight_on_input"]:
                # The weight is already folded into the input there: a zero weight would not drop a slot.
                raise NotImplementedError("beam_hpu CPU expert parallel: apply_router_weight_on_input is "
                                          "not supported with --enable-expert-parallel")
            a["topk_ids"], a["topk_weights"] = remap_topk_to_local(a["topk_ids"], a["topk_weights"],
                                                                   a["expert_map"])
        return stock_apply(*call.args, **call.kwargs)

    return apply


def install() -> None:
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    wrap(cpu_moe.CPUUnquantizedExperts, "apply", _apply_with_expert_map, patch=NAME)
