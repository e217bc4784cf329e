"""Runtime patch `fp8-checkpoint-check`: `beam_hpu.quant.checkpoint_check.check_before_load` at
the start of every vLLM loader's `load_model`, before the model is built."""

from __future__ import annotations

from beam_hpu.runtime.wrap import wrap

NAME = "fp8-checkpoint-check"


def _load_model(original):
    def load_model(self, vllm_config, model_config, *args, **kwargs):
        from beam_hpu.quant.checkpoint_check import check_before_load

        check_before_load(model_config)
        return original(self, vllm_config, model_config, *args, **kwargs)

    return load_model


def install() -> None:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    wrap(BaseModelLoader, "load_model", _load_model, patch=NAME)
