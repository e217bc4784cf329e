"""Copies of a good FP8 tiny checkpoint with one defect each, for the load-refusal tests."""

import json
import shutil
from pathlib import Path

import torch

WRONG_SHAPE = "model.layers.2.mlp.experts.3.up_proj.weight_scale"
MISSING = "model.layers.0.self_attn.o_proj.weight_scale"
MISSING_EXPERT = "model.layers.4.mlp.experts.6.down_proj.weight_scale"


def edit_tensors(src: Path, dst: Path, edit) -> Path:
    """Copy `src` to `dst`, then apply `edit(tensors) -> tensors` to each shard (index kept in step)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(dst.glob("*.safetensors")):
        tensors = edit(load_file(str(shard)))
        save_file(tensors, str(shard), metadata={"format": "pt"})
        for name in [n for n, f in index["weight_map"].items() if f == shard.name and n not in tensors]:
            del index["weight_map"][name]
    index_path.write_text(json.dumps(index, indent=2))
    return dst


def wrong_shape_scale(src: Path, dst: Path) -> Path:
    """One expert's scale stored per tensor ([1, 1]) instead of per channel ([out, 1])."""
    def edit(t):
        if WRONG_SHAPE in t:
            t[WRONG_SHAPE] = t[WRONG_SHAPE].amax().reshape(1, 1).contiguous()
        return t
    return edit_tensors(src, dst, edit)


def missing_scale(src: Path, dst: Path, victim: str = MISSING) -> Path:
    def edit(t):
        t.pop(victim, None)
        return t
    return edit_tensors(src, dst, edit)


def unsupported_scheme(src: Path, dst: Path) -> Path:
    """The same tensors, but the config claims static per-tensor activation scales (FP8 W8A8 static)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for group in cfg["quantization_config"]["config_groups"].values():
        group["input_activations"].update(strategy="tensor", dynamic=False)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def unquantised_target(src: Path, dst: Path) -> Path:
    """A targeted weight left in bf16 (its scale dropped)."""
    name = "model.layers.1.self_attn.q_proj"

    def edit(t):
        if f"{name}.weight" in t:
            t[f"{name}.weight"] = (t[f"{name}.weight"].float() * t.pop(f"{name}.weight_scale")).to(torch.bfloat16)
        return t
    return edit_tensors(src, dst, edit)
