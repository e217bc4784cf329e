"""This rank's load plan: probe every checkpoint tensor, then check the plan loads the model whole.

"Whole" means every element of every parameter is written exactly once: nothing the model needs is
missing from the checkpoint and no two tensors land in the same place.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from beam_hpu.loader.checkpoint import Checkpoint, CheckpointError
from beam_hpu.loader.geometry import overlaps_and_gaps
from beam_hpu.loader.param_index import ParamIndex, Write
from beam_hpu.loader.probe import TensorPlan, probe_tensor

MAX_LISTED = 8


def plan_rank(model: torch.nn.Module, ckpt: Checkpoint) -> tuple[list[TensorPlan], ParamIndex]:
    params = ParamIndex(model)
    plans = [probe_tensor(model, e, params) for e in sorted(ckpt.tensors.values(), key=lambda e: (e.file, e.offset))]
    return plans, params


def check_complete(model: torch.nn.Module, writes: list[Write], ckpt_dir, optional: frozenset[str] = frozenset()) -> None:
    """Raise naming the parameters left unloaded or loaded twice (and by which tensors).

    `optional`: parameters a checkpoint may leave out (their defaults stand), e.g. KV-cache scales."""
    by_param: dict[str, list[Write]] = defaultdict(list)
    for w in writes:
        by_param[w.param].append(w)
    problems = []
    for name, p in model.named_parameters():
        ws = by_param.get(name, [])
        if not ws and name in optional:
            continue
        overlap, gaps = overlaps_and_gaps([r for w in ws for r in w.runs], p.numel())
        if gaps:
            problems.append(f"{name} {list(p.shape)}: {gaps} of {p.numel()} elements not in any checkpoint tensor")
        if overlap:
            problems.append(f"{name}: {overlap} elements written more than once, by {overlapping_tensors(ws)}")
    if problems:
        more = f" (and {len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
        raise CheckpointError(f"{ckpt_dir}: the checkpoint does not load this model exactly once:\n  "
                              + "\n  ".join(problems[:MAX_LISTED]) + more)


def overlapping_tensors(writes: list[Write]) -> list[str]:
    """Names of the tensors whose writes land on elements another tensor also wrote."""
    runs = sorted((s, s + n, w.tensor) for w in writes for s, n in w.runs)
    culprits, reach, reach_tensor = set(), -1, None
    for start, end, tensor in runs:
        if start < reach and tensor != reach_tensor:
            culprits |= {tensor, reach_tensor}
        if end > reach:
            reach, reach_tensor = end, tensor
    return sorted(culprits)[:MAX_LISTED]


def known_writes(plans: list[TensorPlan]) -> list[Write]:
    return [w for p in plans if p.writes for w in p.writes]
