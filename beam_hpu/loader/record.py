"""Run the model's loader on a real tensor and note which parameter elements it wrote."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from beam_hpu.loader.param_index import ParamIndex, Write
from beam_hpu.loader.probe import mutated_tensors


class _RecordWrites(TorchDispatchMode):
    def __init__(self, params: ParamIndex):
        super().__init__()
        self.params = params
        self.written: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.written.extend(mutated_tensors(func, args, kwargs))
        out = func(*args, **kwargs)
        self.params.follow(func, args, kwargs, out)
        return out


def record_writes(model: torch.nn.Module, params: ParamIndex, name: str, tensor: torch.Tensor) -> list[Write]:
    mode = _RecordWrites(params)
    with mode:
        model.load_weights([(name, tensor)])
    return [w for w in (params.writes(t, name) for t in mode.written) if w]
