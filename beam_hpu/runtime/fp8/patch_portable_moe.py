"""Runtime patch `portable-fp8-moe`: a Beam model's compressed-tensors W8A8 FP8 experts go to
`beam_hpu.runtime.fp8.portable_moe.PortableFp8MoEMethod` where vLLM found no FP8 MoE backend (the
Beam check is in `portable_replacement`)."""

from __future__ import annotations

from beam_hpu.runtime.wrap import wrap

NAME = "portable-fp8-moe"


def _get_moe_method(stock_get_moe_method):
    def get_moe_method(quant_config, layer, layer_name):
        from beam_hpu.runtime.fp8.portable_moe import portable_replacement

        method = stock_get_moe_method(quant_config, layer, layer_name)
        return portable_replacement(method, layer, layer_name) or method

    return get_moe_method


def install() -> None:
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe,
    )

    wrap(compressed_tensors_moe.CompressedTensorsMoEMethod, "get_moe_method", _get_moe_method, patch=NAME)
