"""What an HPU graph is looked up by and how a replay binds its inputs, restated from Habana's
public bridge, HabanaAI/gaudi-pytorch-bridge python_packages/habana_frameworks/torch/hpu/graphs.py:

- `input_hash` walks dicts by items, tuples and lists by element, hashes a tensor by its shape and
  `_hpu_C.get_view_hash(tensor)`, anything else by value (`bridge_hash`);
- `wrapped_hpugraph_forward` with `disable_tensor_cache=True` (how vllm-gaudi wraps the model in
  lazy mode) replays with `get_user_input_tensor_list(inputs)`: the tensors of the same walk, by
  position (`bridge_tensors`). The key holds no dtype, so a replay whose tensor at some position
  has the captured shape but another dtype or layout is bound to the captured graph anyway
  (`replay_mismatches` names such positions).

`get_view_hash` is C++ whose source the public snapshot does not carry: `view_hash` is our model of
it (0 for a tensor that is no view; a view's strides, storage offset and base shape otherwise), so
a key that differs only by it must be confirmed on a card (the graph count of a warmed-up run).
"""
from __future__ import annotations

import torch


def view_hash(tensor: torch.Tensor) -> int:
    if tensor._base is None:
        return 0
    return hash((tensor.stride(), tensor.storage_offset(), tuple(tensor._base.shape)))


def bridge_hash(obj):
    if isinstance(obj, dict):
        return bridge_hash(tuple(obj.items()))
    if isinstance(obj, (list, tuple)):
        return hash(tuple(bridge_hash(x) for x in obj))
    if torch.is_tensor(obj):
        return hash((obj.shape, view_hash(obj)))
    return hash(obj)


def bridge_tensors(obj) -> list:
    if isinstance(obj, dict):
        return [t for kv in obj.items() for t in bridge_tensors(kv)]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in bridge_tensors(x)]
    return [obj] if torch.is_tensor(obj) else []


def replay_mismatches(captured: list, replayed: list) -> list[str]:
    """Positions where a replay's input tensor is not what the captured graph was built for (shape,
    dtype, strides); the graph would read it as the captured one."""
    if len(captured) != len(replayed):
        return [f"{len(replayed)} input tensors, the graph was captured with {len(captured)}"]
    return [f"input {i}: {tuple(r.shape)} {r.dtype} strides {r.stride()}, captured "
            f"{tuple(c.shape)} {c.dtype} strides {c.stride()}"
            for i, (c, r) in enumerate(zip(captured, replayed))
            if (c.shape, c.dtype, c.stride()) != (r.shape, r.dtype, r.stride())]
