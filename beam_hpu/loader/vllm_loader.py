"""`--load-format beam` for vLLM 0.30.0: a BaseModelLoader that reads only this rank's bytes."""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from beam_hpu.loader.load import load_checkpoint
from beam_hpu.location import local_checkpoint_dir
from beam_hpu.loader.options import LoaderOptions


def rank_label() -> str:
    if not torch.distributed.is_initialized():
        return "rank 0"
    return f"rank {torch.distributed.get_rank()}/{torch.distributed.get_world_size()}"


def optional_parameters(model: nn.Module) -> frozenset[str]:
    """Parameters vLLM gives defaults when the checkpoint has none: an Attention layer's own
    KV-cache quantisation scales / zero points (created under a quantised config, filled with
    defaults in process_weights_after_loading when not loaded)."""
    from vllm.model_executor.layers.attention import Attention

    return frozenset(f"{mod_name}.{p_name}" for mod_name, mod in model.named_modules() if isinstance(mod, Attention)
                     for p_name, _ in mod.named_parameters(recurse=False))


class BeamModelLoader(BaseModelLoader):
    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        # Checked here, at engine start in every worker, before any model is built.
        self.options = LoaderOptions.from_extra_config(load_config.model_loader_extra_config)

    @staticmethod
    def checkpoint_dir(model_config: ModelConfig) -> str:
        path = local_checkpoint_dir(model_config.model, model_config.revision)
        if path is None:
            raise ValueError(f"--load-format beam reads a checkpoint on this host; {model_config.model!r} is "
                             f"neither a directory nor in the local Hugging Face cache (download it first, "
                             f"e.g. `hf download`)")
        return str(path)

    def download_model(self, model_config: ModelConfig) -> None:
        self.checkpoint_dir(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        from beam_hpu.model.beam import BeamForCausalLM

        if not isinstance(model, BeamForCausalLM):
            # A speculative drafter (EAGLE3 etc.) is loaded with the target's load format. Its own
            # load_weights renames its checkpoint's tensors and leaves the embedding to be shared
            # from the target afterwards, which an exactly-once check of its files would refuse:
            # vLLM's default loader reads it, as it would without --load-format beam.
            import dataclasses

            from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

            DefaultModelLoader(dataclasses.replace(self.load_config, load_format="auto")).load_weights(model, model_config)
            return
        report = load_checkpoint(model, self.checkpoint_dir(model_config), self.options, rank_label(),
                                 optional_parameters(model))
        # For tests and benchmarks that ask the worker what it read (`LLM.apply_model`).
        model.beam_load_report = report.as_dict()
