"""Build a Beam model in this process (no engine) and load a checkpoint into it with a vLLM load
format, optionally with the Gaudi 2 FP8 loaders (tests/support/gaudi2_weights.py); keep the state
the loader left, before `process_weights_after_loading` repacks it. For `beam`, also what the probe
planned per checkpoint tensor ("place": read into its slots, "replay": run the model's loader on it).

`python -m tests.support.inprocess_load SPEC OUT`: SPEC is JSON {"model": dir, "runs": [[label,
load_format, gaudi2], ...]}; OUT gets {label: {"state": state dict, "plans": {tensor: kind}}} from
torch.save. A fresh interpreter each time: vLLM's one-rank process group is set up once per process.
"""

from __future__ import annotations

import json
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch


def one_rank(rendezvous: Path) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{rendezvous}")
        initialize_model_parallel(1, 1)


def plan_kinds(model: torch.nn.Module, model_dir: str) -> dict[str, str]:
    from beam_hpu.loader.checkpoint import open_checkpoint
    from beam_hpu.loader.plan import plan_rank

    plans, _ = plan_rank(model, open_checkpoint(model_dir))
    return {p.entry.name: "place" if p.replay_runs is None else "replay" for p in plans}


def load(model_dir: str, load_format: str, gaudi2: bool) -> dict:
    from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from tests.support.gaudi2_weights import gaudi2_fp8_loaders

    model_config = ModelConfig(model=model_dir, dtype="bfloat16", max_model_len=256, skip_tokenizer_init=True)
    vllm_config = VllmConfig(model_config=model_config, load_config=LoadConfig(load_format=load_format))
    loader = get_model_loader(vllm_config.load_config)
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
        with gaudi2_fp8_loaders() if gaudi2 else nullcontext():
            model = initialize_model(vllm_config=vllm_config)
        plans = plan_kinds(model, model_dir) if load_format == "beam" else {}
        loader.load_weights(model, model_config)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "plans": plans}


def main(spec_path: str, out_path: str) -> None:
    import beam_hpu

    spec = json.loads(Path(spec_path).read_text())
    beam_hpu.register()
    with tempfile.TemporaryDirectory() as d:
        one_rank(Path(d) / "rendezvous")
        loads = {label: load(spec["model"], load_format, gaudi2) for label, load_format, gaudi2 in spec["runs"]}
    torch.save(loads, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
