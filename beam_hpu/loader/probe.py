"""Ask the model's own weight loaders which bytes of a checkpoint tensor this rank needs.

Each checkpoint tensor is handed to `model.load_weights` as a *meta* tensor of its real shape and
dtype, under a dispatch mode that watches what the loaders do with it: the views they take (TP
narrowing, an expert's rows) are computed on meta, and each `copy_` into a parameter is recorded
instead of run. So the TP slice, the expert's local slot, the q/k/v offset inside qkv all come
from vLLM's and the model's code, not from rules re-derived here. A rank whose loader skips a
tensor (an expert that lives on another rank) records nothing and reads nothing.

A loader that computes on the tensor instead of copying a view of it (Beam's per-head gate bias
is repeated over head_dim) marks the tensor for *replay*: the needed elements are read and the
real loader runs on them. A loader that needs values (or mixes meta with real tensors) makes the
probe fall back to replaying the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from beam_hpu.loader.checkpoint import CheckpointError, TensorEntry
from beam_hpu.loader.geometry import view_runs
from beam_hpu.loader.param_index import ParamIndex, Write

aten = torch.ops.aten
# Conversions vLLM does on its own (--dtype); anything else (FP8 into bf16, ints) is a mismatch.
CASTABLE = {torch.float16, torch.bfloat16, torch.float32, torch.float64}


@dataclass
class Placement:
    """Copy the elements `src_runs` (C order) of a checkpoint tensor into the parameter view `dst`."""

    src_runs: list[tuple[int, int]]
    src_shape: tuple[int, ...]
    dst: torch.Tensor
    param: str


@dataclass
class TensorPlan:
    entry: TensorEntry
    placements: list[Placement] = field(default_factory=list)
    # Replay: read these runs into a full-shape host tensor and run the model's loader on it.
    replay_runs: list[tuple[int, int]] | None = None
    writes: list[Write] = field(default_factory=list)  # None-replay writes are known only after replay

    @property
    def needed_runs(self) -> list[tuple[int, int]]:
        if self.replay_runs is not None:
            return self.replay_runs
        return [r for p in self.placements for r in p.src_runs]


class _WholeTensorNeeded(Exception):
    """The loader needs the tensor's values (or a real device) while probing."""


class _ProbeMode(TorchDispatchMode):
    def __init__(self, base: torch.Tensor, params: ParamIndex):
        super().__init__()
        self.params = params
        # A meta tensor's storage is a host-side object, never on the device: its identity tells
        # the checkpoint tensor's views from other meta tensors on any backend.
        self.base_storage = base.untyped_storage()._cdata
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (src view of base, real dst view)
        self.consumed: list[torch.Tensor] = []  # views of base that a computing op read
        self.written: list[torch.Tensor] = []  # real views written with computed or real data

    def tracked(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.is_meta and t.untyped_storage()._cdata == self.base_storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        metas = [t for t in tensors if t.is_meta]
        if func is aten.copy_.default and metas and not args[0].is_meta:
            dst, src = args[0], args[1]
            if self.tracked(src):
                self.copies.append((src, dst))
            else:
                self.consumed.append(src)  # derived data: the real loader must run
                self.written.append(dst)
            return dst
        if not metas:  # real work on real tensors (e.g. zeroing vocab padding rows): run and note it
            self.written.extend(mutated_tensors(func, args, kwargs))
            out = func(*args, **kwargs)
            self.params.follow(func, args, kwargs, out)  # e.g. param.data.narrow(...)
            return out
        if len(metas) != len(tensors):
            raise _WholeTensorNeeded(f"{func} mixes the checkpoint tensor with real tensors")
        if not func.is_view:
            self.consumed.extend(t for t in metas if self.tracked(t))
        try:
            return func(*args, **kwargs)
        except Exception as e:  # e.g. .item() or a branch on values
            raise _WholeTensorNeeded(f"{func} on a meta tensor: {e}") from None


def mutated_tensors(func, args, kwargs) -> list[torch.Tensor]:
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


def probe_tensor(model: torch.nn.Module, entry: TensorEntry, params: ParamIndex) -> TensorPlan:
    """What `model.load_weights` does with `entry` on this rank, without reading it."""
    base = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
    mode = _ProbeMode(base, params)
    plan = TensorPlan(entry)
    try:
        with mode:
            model.load_weights([(entry.name, base)])
    except _WholeTensorNeeded:
        plan.replay_runs = [(0, base.numel())] if base.numel() else []
        plan.writes = None  # known once the real loader has run
        return plan
    except Exception as e:
        raise CheckpointError(f"{entry.file}: tensor {entry.name!r} ({_describe(entry)}) does not fit the model: "
                              f"{type(e).__name__}: {e}") from e
    for src, dst in mode.copies:
        found = params.find(dst)
        name = found.name if found else f"<non-parameter tensor {tuple(dst.shape)}>"
        _check_fits(entry, src, dst, name)
        plan.placements.append(Placement(view_runs(src), tuple(src.shape), dst, name))
    plan.writes = [w for w in (params.writes(d, entry.name) for _, d in mode.copies) if w]
    plan.writes += [w for w in (params.writes(d, entry.name) for d in mode.written) if w]
    if mode.consumed:
        runs = [r for p in plan.placements for r in p.src_runs]
        runs += [r for t in mode.consumed if mode.tracked(t) for r in view_runs(t)]
        plan.replay_runs = _union(runs)
        plan.placements = []
    return plan


def _check_fits(entry: TensorEntry, src: torch.Tensor, dst: torch.Tensor, param: str) -> None:
    where = f"{entry.file}: tensor {entry.name!r} ({_describe(entry)})"
    if src.dtype != dst.dtype and not (src.dtype in CASTABLE and dst.dtype in CASTABLE):
        raise CheckpointError(f"{where}: dtype {src.dtype} does not match the model's {param} ({dst.dtype})")
    try:
        fits = torch.broadcast_shapes(src.shape, dst.shape) == dst.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise CheckpointError(f"{where}: a {list(src.shape)} slice does not fit {param} "
                              f"(slot {list(dst.shape)})")


def _describe(entry: TensorEntry) -> str:
    return f"{str(entry.dtype).removeprefix('torch.')} {list(entry.shape)}"


def _union(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for s, n in sorted(runs):
        if out and s <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], s + n - out[-1][0])
        else:
            out.append([s, n])
    return [(s, n) for s, n in out]
