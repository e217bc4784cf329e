"""Every step a runner builds under a window-sized KV cache carries one attention metadata per
KV-cache group: the rules for building them from vllm-gaudi's own per-table builders, as plain
functions.

vllm-gaudi's input preparation (prefill with context, chunked and merged prefill, decodes,
speculative verify rows, DP padding's dummy batches) reads one block table: the group
`_get_attention_group_id_for_hybrid()` names. Under a window-sized cache (vLLM's hybrid groups:
Beam's 1 full + 5 sliding groups, `window_kv`) each group has its own table, and everything a step
computes but its metadata (token ids, positions, padding, bucket, logits indices, spec-decode
metadata) depends only on the requests' lengths, never on which blocks hold their keys. So the step
is built once per group with that group selected (`build_per_group`) and the builds are combined
(`combine_step_inputs`): the first build's inputs, with each attention metadata replaced by a
`window_kv.GroupedMetadata` of the groups' metadata. A field other than the metadata that differs
between groups is a bug in that rule and raises, naming the field; so does a metadata tensor one
group's build shares with another's (a persistent buffer the second build overwrote).

With no sliding-window group (the switch off, another model) `step_groups` is None and the runner
builds the step once, as stock.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from beam_hpu.names import MODEL_TYPE
from beam_hpu.scope import is_beam_model_type
from beam_hpu.runtime.window_kv.groups import GroupedMetadata, layer_groups, primary_group, tensor_root

METADATA_FIELD = "attn_metadata"


@dataclass(frozen=True)
class StepGroups:
    """The KV-cache groups a step builds metadata for: their layers and windows (None = full)."""

    group_layer_names: tuple[tuple[str, ...], ...]
    windows: tuple[int | None, ...]

    @property
    def primary(self) -> int:
        return primary_group(self.windows)


def step_groups(kv_cache_config, model_type: str | None) -> StepGroups | None:
    """The groups of a window-sized cache, or None when the runner builds each step once (stock):
    no config yet, or no `SlidingWindowSpec` group. Only the window-KV spec (Beam with
    BEAM_WINDOW_KV) makes sliding groups on vllm-gaudi; one under another model type, or beside a
    group that is not attention (mamba state), is refused rather than served half right."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not groups:
        return None
    from vllm.v1.kv_cache_interface import AttentionSpec, SlidingWindowSpec

    if not any(isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in groups):
        return None
    if not is_beam_model_type(model_type):
        raise ValueError(f"sliding-window KV-cache groups for model type {model_type!r}: only {MODEL_TYPE} builds them")
    other = [type(g.kv_cache_spec).__name__ for g in groups if not isinstance(g.kv_cache_spec, AttentionSpec)]
    if other:
        raise ValueError(f"a window-sized KV cache beside non-attention groups ({other}) is not served")
    windows = tuple(g.kv_cache_spec.sliding_window if isinstance(g.kv_cache_spec, SlidingWindowSpec) else None
                    for g in groups)
    return StepGroups(tuple(tuple(g.layer_names) for g in groups), windows)


def runner_step_groups(runner) -> StepGroups | None:
    """`step_groups` for a vllm-gaudi HPUModelRunner (its kv_cache_config, its model type)."""
    config = getattr(runner, "kv_cache_config", None)
    if not getattr(config, "kv_cache_groups", None):
        return None
    return step_groups(config, runner._get_model_type())


def draft_group(groups: StepGroups | None, drafter_layer_names: Sequence[str] = ()) -> int:
    """The block table the EAGLE draft step reads: 0 as stock without window groups; else the
    full group holding the drafter's layers (`window_kv.allocation_windows` allocates the
    drafter's odd window full, so they sit beside Beam's full layers), which must hold them all."""
    if groups is None:
        return 0
    if not drafter_layer_names:
        return groups.primary
    of = layer_groups(groups.group_layer_names)
    missing = [n for n in drafter_layer_names if n not in of]
    if missing:
        raise ValueError(f"drafter layers {missing} are in no KV-cache group")
    gids = sorted({of[n] for n in drafter_layer_names})
    if len(gids) != 1 or groups.windows[gids[0]] is not None:
        raise ValueError(f"drafter layers sit in groups {gids} (windows {[groups.windows[g] for g in gids]}): "
                         "the draft step reads one full-attention group's table")
    return gids[0]


def build_per_group(groups: StepGroups, build: Callable[[], object], select: Callable[[int | None], None],
                    appended: Sequence[list] = ()) -> list:
    """`build()` once per group, with `select(g)` naming the group whose table it reads (and
    `select(None)` after, also on error). `appended` are runner lists a build appends to (the
    async scheduler's invalid request indices): every build must append the same items, kept
    once."""
    starts = [len(lst) for lst in appended]
    first_tails: list[list] | None = None
    outs = []
    for g in range(len(groups.group_layer_names)):
        select(g)
        try:
            outs.append(build())
        finally:
            select(None)
        tails = [lst[start:] for lst, start in zip(appended, starts)]
        if first_tails is None:
            first_tails = tails
        elif tails != first_tails:
            raise ValueError(f"group {g}'s build appended {tails}, group 0's {first_tails}")
        for lst, start in zip(appended, starts):
            del lst[start:]
    for lst, tail in zip(appended, first_tails or []):
        lst.extend(tail)
    return outs


def _fields(obj) -> dict | None:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if hasattr(obj, "__dict__") and not isinstance(obj, (torch.Tensor, np.ndarray, type)):
        return dict(vars(obj))
    return None


def same_value(values: Sequence, path: str) -> None:
    """Raise ValueError naming `path` unless every value equals the first. Host tensors and arrays
    compare by dtype, shape and contents; device tensors by dtype, shape and device (reading their
    contents back would stall the step; the CPU tests compare them)."""
    first = values[0]
    for g, v in enumerate(values[1:], start=1):
        if type(v) is not type(first):
            raise ValueError(f"{path}: group {g} has {type(v).__name__}, group 0 {type(first).__name__}")
        if isinstance(first, torch.Tensor):
            if (v.dtype, v.shape, v.device) != (first.dtype, first.shape, first.device):
                raise ValueError(f"{path}: group {g} is {v.dtype} {tuple(v.shape)} on {v.device}, group 0 "
                                 f"{first.dtype} {tuple(first.shape)} on {first.device}")
            if first.device.type == "cpu" and not torch.equal(v, first):
                raise ValueError(f"{path}: group {g}'s values differ from group 0's")
        elif isinstance(first, np.ndarray):
            if v.dtype != first.dtype or not np.array_equal(v, first):
                raise ValueError(f"{path}: group {g}'s array differs from group 0's")
        elif isinstance(first, (list, tuple)):
            if len(v) != len(first):
                raise ValueError(f"{path}: group {g} has {len(v)} items, group 0 {len(first)}")
            for i in range(len(first)):
                same_value([values[0][i], v[i]], f"{path}[{i}]")
        elif isinstance(first, dict):
            if v.keys() != first.keys():
                raise ValueError(f"{path}: group {g}'s keys differ from group 0's")
            for k in first:
                same_value([first[k], v[k]], f"{path}[{k!r}]")
        elif _fields(first) is not None:
            a, b = _fields(first), _fields(v)
            if a.keys() != b.keys():
                raise ValueError(f"{path}: group {g}'s fields differ from group 0's")
            for k in a:
                same_value([a[k], b[k]], f"{path}.{k}")
        elif v != first:
            raise ValueError(f"{path}: group {g} has {v!r}, group 0 {first!r}")


def _buffers(md) -> dict[str, torch.Tensor]:
    """Each non-empty tensor field of a metadata object, as the buffer it is a view of (so two
    views into one persistent buffer count as shared), compared by object: never by storage
    pointer, which is null for every lazy HPU tensor."""
    return {name: tensor_root(value) for name, value in (_fields(md) or {}).items()
            if isinstance(value, torch.Tensor) and value.numel() > 0}


def disjoint_metadata(group_metadata: Sequence, path: str = METADATA_FIELD) -> None:
    """Raise if a tensor of one group's metadata shares a buffer with another group's: the later
    build would have written over the earlier group's block lists or slots."""
    seen: dict[int, tuple[int, str]] = {}
    for g, md in enumerate(group_metadata):
        for name, buffer in _buffers(md).items():
            key = id(buffer)
            if key in seen and seen[key][0] != g:
                other, other_name = seen[key]
                raise ValueError(f"{path}: group {g}'s {name} shares a buffer with group {other}'s {other_name}")
            seen.setdefault(key, (g, name))


def _grouped(group_metadata: Sequence, groups: StepGroups, path: str):
    if all(md is None for md in group_metadata):
        return None
    if any(md is None for md in group_metadata):
        raise ValueError(f"{path}: some groups built no metadata")
    disjoint_metadata(group_metadata, path)
    return GroupedMetadata(list(group_metadata), groups.group_layer_names, groups.primary)


def combine_step_inputs(outs: Sequence, groups: StepGroups, path: str = "step"):
    """One step's inputs from its per-group builds: the structure of `outs[0]` (tuples, None and
    the runner's input records), every field but `attn_metadata` checked equal across groups
    (`same_value`), and each `attn_metadata` (one metadata, or a list of one per prefill batch)
    a GroupedMetadata of the groups' metadata."""
    if len(outs) != len(groups.group_layer_names):
        raise ValueError(f"{len(outs)} builds for {len(groups.group_layer_names)} KV-cache groups")
    first = outs[0]
    if first is None:
        same_value(list(outs), path)
        return None
    if isinstance(first, tuple):
        same_value([len(o) for o in outs], f"{path} length")
        return tuple(combine_step_inputs([o[i] for o in outs], groups, f"{path}[{i}]") for i in range(len(first)))
    fields = _fields(first)
    if fields is None or METADATA_FIELD not in fields:
        same_value(list(outs), path)
        return first
    replaced = {}
    for name in fields:
        values = [getattr(o, name) for o in outs]
        where = f"{path}.{name}"
        if name != METADATA_FIELD:
            same_value(values, where)
        elif isinstance(values[0], list):
            same_value([len(v) for v in values], f"{where} length")
            replaced[name] = [_grouped([v[i] for v in values], groups, f"{where}[{i}]") for i in range(len(values[0]))]
        else:
            replaced[name] = _grouped(values, groups, where)
    if dataclasses.is_dataclass(first):
        return dataclasses.replace(first, **replaced)
    out = copy.copy(first)
    for name, value in replaced.items():
        setattr(out, name, value)
    return out


def runner_step_inputs(runner, build: Callable[[], object]):
    """What HPUModelRunner._prepare_inputs returns: `build()` as stock without window groups;
    with them, built once per group (the runner's `beam_window_kv_group` names the table
    `_get_attention_group_id_for_hybrid` hands the builders) and combined."""
    groups = runner_step_groups(runner)
    if groups is None:
        return build()
    appended = [runner.invalid_req_indices] if isinstance(getattr(runner, "invalid_req_indices", None), list) else []
    outs = build_per_group(groups, build, lambda g: setattr(runner, "beam_window_kv_group", g), appended)
    return combine_step_inputs(outs, groups)


def runner_draft_group(runner) -> int:
    """`draft_group` for a runner: its groups and its drafter's attention layers."""
    names = sorted(getattr(getattr(runner, "drafter", None), "_draft_attn_layer_names", None) or ())
    return draft_group(runner_step_groups(runner), names)
