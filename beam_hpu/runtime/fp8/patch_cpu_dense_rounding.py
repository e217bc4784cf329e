"""Runtime patch `cpu-fp8-dense-rounding`: vLLM-CPU's FP8 linear kernels built for a Beam model
quantise dynamic per-token activations with `beam_hpu.runtime.fp8.cpu_dense_rounding.dense_activation_quantiser`.
Kernels of any other model (or made outside vLLM's model build) keep vLLM's QuantFP8."""

from __future__ import annotations

from beam_hpu.runtime.wrap import wrap

NAME = "cpu-fp8-dense-rounding"


def _init(stock_init):
    def __init__(self, c, *args, **kwargs):
        from beam_hpu.runtime.fp8.cpu_dense_rounding import dense_activation_quantiser, is_dynamic_per_token
        from beam_hpu.scope import building_beam

        stock_init(self, c, *args, **kwargs)
        if is_dynamic_per_token(c) and building_beam():
            self.quant_fp8 = dense_activation_quantiser()

    return __init__


def install() -> None:
    import importlib

    # The package re-exports a class of the module's name: import the module itself.
    kernels = importlib.import_module("vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel")
    wrap(kernels.FP8ScaledMMLinearKernel, "__init__", _init, patch=NAME)
