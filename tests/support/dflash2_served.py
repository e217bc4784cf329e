"""The committed tiny DFlash2 drafter as vLLM builds it (beam_hpu.model.dflash2), in this process:
for tests that drive the proposer without an engine."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from beam_hpu.tiny.dflash2_drafter import DFLASH2_DIR, read_dflash2


def one_rank() -> None:
    """vLLM's parallel state for one CPU rank (its linears ask for the tensor-parallel size)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    with set_current_vllm_config(VllmConfig()), tempfile.TemporaryDirectory() as d:
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{Path(d) / 'rendezvous'}")
        initialize_model_parallel(1, 1)


def tiny_dflash2(seed: int = 0, **config_changes):
    """The committed drafter's weights by their published names, a random embedding and LM head
    (the target's, in serving), vLLM's post-load step run. float32."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    from beam_hpu.model.dflash2 import DFlash2BeamForCausalLM

    one_rank()
    config = SimpleNamespace(**{**json.loads((DFLASH2_DIR / "config.json").read_text()), **config_changes})
    model = DFlash2BeamForCausalLM(vllm_config=SimpleNamespace(model_config=SimpleNamespace(hf_config=config)))
    model.load_weights(read_dflash2(DFLASH2_DIR).items())
    g = torch.Generator().manual_seed(seed)
    for weight in (model.model.embed_tokens.weight, model.lm_head.weight):
        weight.data.copy_(torch.randn(weight.shape, generator=g) / config.hidden_size**0.5)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(module)
    return model.eval()
