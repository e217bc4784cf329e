"""FP8 weight loading as vllm-gaudi does it on Gaudi 2, for loader tests on CPU.

Gaudi 2's FP8 (E4M3) tops out at 240, not 448, so on Gaudi 2 vllm-gaudi wraps the weight loader
of every parameter its FP8 methods create (`gaudi_weight_wrapper` in vllm_gaudi/extension/ops.py,
applied in the `create_weights` of its FP8 linear and MoE methods, vllm_gaudi/ops/hpu_fp8.py and
vllm_gaudi/ops/hpu_compressed_tensors.py, under `hpu_ops.is_hpu_gaudi2`, with the default
VLLM_SCALE_ADJUSTMENT on): an FP8 tensor is halved (computed in fp32, cast back to FP8) and any
other tensor, i.e. a scale, doubled, before the layer's own loader places it. The product of
weight and scale is unchanged. Written here from that description, for vLLM's own
compressed-tensors FP8 methods, which vllm-gaudi subclasses.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def to_gaudi2_range(loaded: torch.Tensor) -> torch.Tensor:
    if loaded.dtype == torch.float8_e4m3fn:
        return (loaded.to(torch.float32) / 2).to(torch.float8_e4m3fn)
    return loaded * 2


def gaudi2_weight_loader(weight_loader):
    """`weight_loader` taking the checkpoint tensor into Gaudi 2's FP8 range first."""

    def load(*args, **kwargs):
        if "loaded_weight" in kwargs:  # vLLM's MoE loader may be called with keywords only
            kwargs["loaded_weight"] = to_gaudi2_range(kwargs["loaded_weight"])
        else:
            args = (args[0], to_gaudi2_range(args[1]), *args[2:])
        return weight_loader(*args, **kwargs)

    return load


@contextmanager
def gaudi2_fp8_loaders():
    """While a model is built inside, vLLM's compressed-tensors FP8 linear and MoE methods create
    their parameters with the Gaudi 2 loader, as vllm-gaudi's subclasses of them do."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsLinearMethod,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w8a8_fp8 import (  # noqa: E501
        CompressedTensorsW8A8Fp8MoEMethod,
    )

    methods = (CompressedTensorsLinearMethod, CompressedTensorsW8A8Fp8MoEMethod)
    originals = {cls: cls.__dict__["create_weights"] for cls in methods}

    def wrapping(create_weights):
        def create_weights_for_gaudi2(self, *args, **kwargs):
            kwargs["weight_loader"] = gaudi2_weight_loader(kwargs["weight_loader"])
            return create_weights(self, *args, **kwargs)

        return create_weights_for_gaudi2

    for cls, create_weights in originals.items():
        cls.create_weights = wrapping(create_weights)
    try:
        yield
    finally:
        for cls, create_weights in originals.items():
            cls.create_weights = create_weights
