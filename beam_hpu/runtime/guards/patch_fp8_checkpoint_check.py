"""Runtime patch `fp8-checkpoint-check`: `beam_hpu.quant.checkpoint_check.check_before_load` at
the start of every vLLM loader's `load_model` that reads a checkpoint, before the model is built
(the dummy loader reads none: it draws the weights, as card-check's synthetic Beam asks)."""

from __future__ import annotations

from beam_hpu.runtime.wrap import wrap

NAME = "fp8-checkpoint-check"


def _load_model(original):
    def load_model(self, vllm_config, model_config, *args, **kwargs):
        from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

        from beam_hpu.quant.checkpoint_check import check_before_load

        if not isinstance(self, DummyModelLoader):
            check_before_load(model_config)
        return original(self, vllm_config, model_config, *args, **kwargs)

    return load_model


def install() -> None:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    wrap(BaseModelLoader, "load_model", _load_model, patch=NAME)
