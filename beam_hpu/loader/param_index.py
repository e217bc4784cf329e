"""Which parameter a tensor that a weight loader writes into belongs to, and which of its elements.

Loaders reach a parameter through aliases and views: `param.data` (a new alias object on every
access), `param.data.narrow(...)`, `param[...]`, an expert's `param.data[expert_id]`. On Gaudi a
lazy tensor's storage has a null data pointer and a view need not share its base's storage, so
storage pointers (and storage objects) cannot tell parameters or views apart there.

Instead each alias and view taken while a loader runs is followed at dispatch, starting from the
parameter objects themselves: `.data` dispatches `aten.detach`, a view op receives the tensor it
is taken from, so every alias or view object is mapped to its parameter as it is made. The same
view op is replayed on the parameter's *layout*, a meta tensor of its shape and strides starting
at offset 0: the layout of a view gives its element offsets within the parameter, derived from
the chain of view ops alone, whatever the device's storage says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from beam_hpu.loader.geometry import view_runs


@dataclass
class Write:
    """Elements `runs` of parameter `param` (relative to its first element) written by `tensor`."""

    param: str
    tensor: str
    runs: list[tuple[int, int]]


@dataclass(frozen=True)
class ParamView:
    """A tensor that is (a view of) parameter `name`."""

    name: str
    param: torch.Tensor  # the whole parameter's data: where a staged copy of it lands
    layout: torch.Tensor  # meta: the view's shape and strides, offset from the parameter's first element


class ParamIndex:
    """Parameters and buffers of a model, and every alias or view of them followed so far."""

    def __init__(self, model: torch.nn.Module):
        # id() is only unique among live objects: each indexed tensor is kept alive beside its entry.
        self._known: dict[int, tuple[torch.Tensor, ParamView]] = {}
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.numel() or id(t) in self._known:
                continue
            data = t.data
            whole = ParamView(name, data, torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"))
            self._known[id(t)] = (t, whole)
            self._known[id(data)] = (data, whole)

    def find(self, view: torch.Tensor) -> ParamView | None:
        entry = self._known.get(id(view))
        return entry[1] if entry is not None and entry[0] is view else None

    def follow(self, func, args, kwargs, out) -> None:
        """Index `out` when `func` took it as an alias or view of an indexed tensor (`args[0]`)."""
        if not func.is_view or not args or not isinstance(args[0], torch.Tensor):
            return
        source = self.find(args[0])
        if source is None:
            return
        layouts = func(source.layout, *args[1:], **(kwargs or {}))
        for t, layout in zip(tree_leaves(out), tree_leaves(layouts)):
            if isinstance(t, torch.Tensor):
                self._known[id(t)] = (t, ParamView(source.name, source.param, layout))

    def writes(self, view: torch.Tensor, tensor: str) -> Write | None:
        found = self.find(view)
        if found is None:
            return None
        return Write(found.name, tensor, view_runs(found.layout))


class FollowViews(TorchDispatchMode):
    """Runs every op, indexing the aliases and views of parameters taken meanwhile."""

    def __init__(self, params: ParamIndex):
        super().__init__()
        self.params = params

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.params.follow(func, args, kwargs, out)
        return out
