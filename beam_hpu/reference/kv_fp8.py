"""FP8 KV cache in the reference: every attention layer's keys and values rounded through FP8 with
that layer's static scales before attention reads them, as a server with an FP8 KV cache stores them.

What an FP8 cache holds is `beam_hpu.quant.rounding.fp8_kv_round` (the one definition, shared with
the served path's models and tests); where it applies in transformers' Beam: the keys after
`k_norm` and RoPE (sliding layers) and the values after `v_proj`, i.e. exactly the tensors vLLM's
Beam (`beam_hpu/model/beam.py`) hands its `Attention` layer, which writes them to the cache and
reads every key, the step's own included, back from it. The queries are not rounded: vLLM-CPU
keeps them in the model dtype; vllm-gaudi's FP8 attention also casts queries (q_scale) and, in
decode, the softmax probabilities to FP8, which is NOT modelled here (ports/beam-1-0/README.md says
what a card run must confirm).

How: transformers looks the attention function up by `config._attn_implementation` on every call,
so `install` registers a wrapper of the model's own implementation (sdpa on CPU) under a name of
its own, with the same mask function, and switches the model to it. The wrapper rounds K and V
when the module carries `beam_kv_round` and reports Q, K, V to `beam_kv_observe` (the calibration,
`kv_calibration`); with neither set it is the wrapped function, call for call.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from beam_hpu.quant.rounding import fp8_kv_round

IMPL_PREFIX = "beam_kv_fp8_"
ROUND_ATTR = "beam_kv_round"  # (k_fn, v_fn) or None
OBSERVE_ATTR = "beam_kv_observe"  # fn(layer_idx, q, k, v) or None


@dataclass(frozen=True)
class KvScales:
    """Per attention layer, the checkpoint's (k_scale, v_scale) in compressed-tensors form."""

    layers: dict[int, tuple[float, float]]
    source: str  # where they were read (a directory), for the reference's description

    def describe(self) -> list:
        return [self.source, sorted((i, k, v) for i, (k, v) in self.layers.items())]


def _wrapped(base: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(module, query, key, value, attention_mask, **kwargs):
        observe = getattr(module, OBSERVE_ATTR, None)
        if observe is not None:
            observe(module.layer_idx, query, key, value)  # [B, H, T, D] each
        rounding = getattr(module, ROUND_ATTR, None)
        if rounding is not None:
            key = rounding[0](key).to(key.dtype)
            value = rounding[1](value).to(value.dtype)
        return ALL_ATTENTION_FUNCTIONS[base](module, query, key, value, attention_mask, **kwargs)

    return attention


def install(model) -> None:
    """Switch a transformers Beam (real or on the meta device) to the rounding-capable wrapper of
    its attention implementation; nothing is rounded until `set_kv_rounding`."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    base = model.config._attn_implementation
    if base.startswith(IMPL_PREFIX):
        return
    if base not in ALL_ATTENTION_FUNCTIONS or base not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"attention implementation {base!r}: the FP8 KV reference wraps registered "
                         f"implementations with a mask function (sdpa, eager, ...)")
    name = IMPL_PREFIX + base
    AttentionInterface.register(name, _wrapped(base))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.set_attn_implementation(name)
    for module in attention_modules(model):
        setattr(module, ROUND_ATTR, None)
        setattr(module, OBSERVE_ATTR, None)


def attention_modules(model) -> list:
    return [layer.self_attn for layer in model.model.layers]


def set_kv_rounding(model, scales: KvScales | None, fp8_max: float, exact: bool = True) -> None:
    """Round every layer's K and V through FP8 of range `fp8_max` with `scales`, or not (None)."""
    for module in attention_modules(model):
        if scales is None:
            setattr(module, ROUND_ATTR, None)
            continue
        k_scale, v_scale = scales.layers[module.layer_idx]
        setattr(module, ROUND_ATTR, (partial(fp8_kv_round, scale=k_scale, fp8_max=fp8_max, exact=exact),
                                     partial(fp8_kv_round, scale=v_scale, fp8_max=fp8_max, exact=exact)))


def set_kv_observer(model, observe) -> None:
    for module in attention_modules(model):
        setattr(module, OBSERVE_ATTR, observe)


def check_layers(scales: KvScales, num_layers: int) -> None:
    missing = [i for i in range(num_layers) if i not in scales.layers]
    if missing:
        raise ValueError(f"{scales.source}: no k_scale / v_scale for attention layer {missing[0]} "
                         f"({len(missing)} of {num_layers} layers missing)")


RANGE_PREFIX = "kv-range/"


def range_key(kind: str, layer: int) -> str:
    return f"{RANGE_PREFIX}{kind}/{layer}"


def amax_observer(ranges: dict[str, torch.Tensor]):
    """An observer keeping, per layer, the running |x| maximum of Q, K and V in `ranges`
    (`range_key` -> fp32 scalar tensor, so they are saved with the hidden states and resume)."""

    def observe(layer: int, q, k, v) -> None:
        for kind, x in (("q", q), ("k", k), ("v", v)):
            key = range_key(kind, layer)
            m = x.detach().abs().amax().float()
            ranges[key] = torch.maximum(ranges[key], m) if key in ranges else m

    return observe
