"""A tensor that, like a lazy tensor of Habana's PyTorch bridge, has no storage to point at.

Its storage has no data pointer to read, and every view of it is a new tensor with a fresh,
contiguous geometry (offset 0): nothing about its storage relates a view to the tensor it was
taken from. The values live in a plain CPU tensor inside, so copies into views still land.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map


class StorageFreeTensor(torch.Tensor):
    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, StorageFreeTensor) else t
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func._schema.is_mutable:  # in place: the result is the (wrapped) argument itself
            return args[0]
        return tree_map(lambda t: StorageFreeTensor(t) if isinstance(t, torch.Tensor) else t, out)

    def __repr__(self):
        return f"StorageFreeTensor({self.inner!r})"
