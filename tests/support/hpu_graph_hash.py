"""What an HPU graph is looked up by, restated from habana_frameworks/torch/hpu/graphs.py (a public
copy, not the card's release): its input_hash walks dicts by items, tuples and lists by element,
hashes tensors by shape and anything else by value; the user input tensors are the tensors of the
same walk (get_user_input_tensor_list)."""
from __future__ import annotations

import torch


def bridge_hash(obj):
    if isinstance(obj, dict):
        return bridge_hash(tuple(obj.items()))
    if isinstance(obj, (list, tuple)):
        return hash(tuple(bridge_hash(x) for x in obj))
    if torch.is_tensor(obj):
        return hash(obj.shape)
    return hash(obj)


def bridge_tensors(obj) -> list:
    if isinstance(obj, dict):
        return [t for kv in obj.items() for t in bridge_tensors(kv)]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in bridge_tensors(x)]
    return [obj] if torch.is_tensor(obj) else []
