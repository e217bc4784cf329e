"""Expert parallel for vLLM-CPU's unquantised (bf16/fp32) expert kernel.

Why: under `--enable-expert-parallel` each rank holds only its experts (`w13_weight` is
[E_local, ...]) and the router still returns *global* expert ids. The runner hands the kernel
`expert_map` (global id -> local id, -1 for another rank's expert), but vLLM 0.30.0's
`CPUUnquantizedExperts.apply` (fused_moe/experts/cpu_moe.py) never passes it on to
`cpu_fused_moe`, which then indexes the local weight tensor with global ids: wrong experts on
rank 0, out-of-bounds reads (a segfault) on the others.

The fix, in two parts:
- `remap_topk_to_local` (a plain function, unit-tested): global ids -> local ids through
  `expert_map`; a slot routed to another rank's expert points at local expert 0 with weight 0,
  so it contributes nothing here and the runner's all-reduce adds the owning rank's share.
- the runtime patch `cpu-expert-parallel` (beam_hpu/runtime/expert_parallel/patch_cpu_expert_parallel.py): on the CPU
  platform only, wraps `CPUUnquantizedExperts.apply` (its AMX/Arm/Power subclasses inherit it) to
  remap when an `expert_map` is given. Without expert parallel `expert_map` is None and the
  wrapper calls the stock kernel unchanged.

Not needed elsewhere: on HPU vllm-gaudi's MoE ops take the expert range themselves; FP8 experts
on CPU run `beam_hpu.runtime.fp8.portable_moe`, which maps ids itself.

Remove when: vLLM's CPU unquantised experts honour `expert_map` (its `apply` passes the map, or
remapped ids, to the kernel). `tests/runtime/expert_parallel/test_cpu_expert_parallel_engine.py` then still passes
without the patch; the unit test here keeps the arithmetic honest until then.
"""

from __future__ import annotations

import torch

def remap_topk_to_local(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        expert_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(global topk ids [T, k], weights [T, k]) -> (local ids, weights) for this rank.

    Slots whose expert lives on another rank get local id 0 and weight 0: a valid index into the
    local weights whose contribution vanishes. Dtypes and shapes are kept.
    """
    local = expert_map[topk_ids.long()]
    elsewhere = local < 0
    ids = torch.where(elsewhere, torch.zeros_like(local), local).to(topk_ids.dtype)
    weights = topk_weights.masked_fill(elsewhere, 0)
    return ids, weights
