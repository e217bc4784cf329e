"""Calibrated FP8 KV-cache scales as an overlay of a checkpoint: one small added shard, index
entries for it and the config's `kv_cache_scheme`; the checkpoint's own shards are never rewritten.

The form is the one compressed-tensors writes and vLLM 0.30.0 reads:
- `quantization_config.kv_cache_scheme` = {"num_bits": 8, "type": "float", "strategy": "tensor",
  "dynamic": false, "symmetric": true} (`CompressedTensorsKVCacheMethod.validate_kv_cache_scheme`
  accepts exactly float / 8 bits / tensor or attn_head / symmetric); with it vLLM creates
  `k_scale`, `v_scale`, `q_scale` parameters on every `Attention` layer (vllm-gaudi's
  `HPUCompressedTensorsConfig` keeps the layer's method and serves it as `fp8_inc`);
- per attention layer `model.layers.{i}.self_attn.{k,v,q}_scale`, fp32 [1], amax / 448
  (`beam_hpu.quant.rounding.kv_cache_scale`; vLLM reads it as it is, vllm-gaudi as amax = scale * 448
  rescaled to its 240, see that module). Beam's loader maps them onto `self_attn.attn.*_scale`.

`--out DIR` is either the checkpoint directory itself (the shard is added, config.json and the
index are replaced atomically, copies of the old ones kept as `*.before-kv-scales`), or a new directory: then
it holds the new config.json, index and shard, and a symlink to every other file of the checkpoint,
so it is served as a checkpoint (`vllm serve DIR`) while the original stays untouched.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from beam_hpu.loader.checkpoint import INDEX_NAME, CheckpointError, open_checkpoint
from beam_hpu.reference.workdir import atomic_write

SHARD_NAME = "kv-scales-beam-hpu.safetensors"
OVERLAY_FORMAT = "beam-kv-scales/1"
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
KINDS = ("k", "v", "q")
BACKUP_SUFFIX = ".before-kv-scales"


def tensor_name(layer: int, kind: str) -> str:
    return f"model.layers.{layer}.self_attn.{kind}_scale"


def check_target(checkpoint_dir: str | Path, out: str | Path) -> tuple[Path, Path, bool]:
    """(checkpoint, out, in_place) once everything is known to be writable; raises before any read."""
    src = Path(checkpoint_dir).resolve()
    config = _config(src)
    qc = config.get("quantization_config")
    if not qc or qc.get("quant_method") != "compressed-tensors":
        raise ValueError(f"{src}/config.json: no compressed-tensors quantization_config; FP8 KV scales go into "
                         f"one (an FP8 checkpoint, e.g. `beam-hpu tiny DIR --fp8` or the published one)")
    if qc.get("kv_cache_scheme") is not None:
        raise ValueError(f"{src}/config.json already has a kv_cache_scheme; calibrate from the checkpoint "
                         f"before it was calibrated (its {'config.json' + BACKUP_SUFFIX} if written in place)")
    out = Path(out).resolve()
    in_place = out == src
    if not in_place and out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out}: exists and is not empty; pass a new directory or the checkpoint itself")
    if not in_place and out.is_relative_to(src):
        raise ValueError(f"--out {out}: inside the checkpoint directory; pass the checkpoint itself or a "
                         f"directory outside it")
    if in_place and (src / SHARD_NAME).exists():
        raise ValueError(f"{src / SHARD_NAME} exists: the checkpoint was calibrated before")
    writable = out if out.exists() else out.parent
    if not os.access(writable, os.W_OK):
        raise ValueError(f"--out {out}: {writable} is not writable")
    return src, out, in_place


def _config(directory: Path) -> dict:
    try:
        return json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{directory}/config.json: {e}") from None


def write_overlay(checkpoint_dir: str | Path, out: str | Path, scales: dict[int, dict[str, float]],
                  metadata: dict[str, str]) -> Path:
    """Write the overlay; `scales`: layer -> {"k": s, "v": s, "q": s} (compressed-tensors form)."""
    from safetensors.torch import save

    src, out, in_place = check_target(checkpoint_dir, out)
    ckpt = open_checkpoint(src)  # headers only
    config = _config(src)
    config["quantization_config"]["kv_cache_scheme"] = dict(KV_CACHE_SCHEME)
    tensors = {tensor_name(i, kind): torch.tensor([s[kind]], dtype=torch.float32)
               for i, s in sorted(scales.items()) for kind in KINDS}
    clash = sorted(set(tensors) & set(ckpt.tensors))
    if clash:
        raise CheckpointError(f"{src}: already has {clash[0]}; KV scales are added, never replaced")
    index_path = src / INDEX_NAME
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:  # a single-file checkpoint gets an index naming its shard, so the added one is found
        index = {"metadata": {}, "weight_map": {n: Path(e.file).name for n, e in ckpt.tensors.items()}}
    index["weight_map"].update({n: SHARD_NAME for n in tensors})
    meta = index.setdefault("metadata", {})
    meta["total_size"] = int(meta.get("total_size", ckpt.total_bytes)) + sum(t.nbytes for t in tensors.values())
    out.mkdir(parents=True, exist_ok=True)
    if not in_place:
        for f in sorted(src.iterdir()):
            if f.name not in ("config.json", INDEX_NAME):
                (out / f.name).symlink_to(f)
    atomic_write(out / SHARD_NAME, save(tensors, metadata={"format": OVERLAY_FORMAT, **metadata}))
    for name, text in ((INDEX_NAME, json.dumps(index, indent=2)), ("config.json", json.dumps(config, indent=2))):
        if in_place and (src / name).exists():
            shutil.copy2(src / name, src / (name + BACKUP_SUFFIX))
        atomic_write(out / name, (text + "\n").encode())
    return out


def read_kv_scales(directory: str | Path):
    """The per-layer (k_scale, v_scale) of a calibrated checkpoint (or overlay) directory."""
    from safetensors import safe_open

    from beam_hpu.reference.kv_fp8 import KvScales

    directory = Path(directory).resolve()
    if not directory.is_dir():
        raise ValueError(f"--kv-scales {directory}: not a directory (an overlay written by `beam-hpu calibrate-kv`)")
    qc = _config(directory).get("quantization_config") or {}
    if qc.get("kv_cache_scheme") is None:
        raise ValueError(f"--kv-scales {directory}: config.json has no kv_cache_scheme (write one with "
                         f"`beam-hpu calibrate-kv`)")
    entries = open_checkpoint(directory).tensors
    found: dict[int, dict[str, float]] = {}
    for name, e in entries.items():
        parts = name.split(".")
        if len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[3] == "self_attn" \
                and parts[4] in ("k_scale", "v_scale"):
            with safe_open(e.file, "pt") as f:
                value = f.get_tensor(name)
            if value.numel() != 1 or not bool(value.float().reshape(()) > 0):
                raise ValueError(f"{e.file}: {name} must be one positive number, is {value.tolist()}")
            found.setdefault(int(parts[2]), {})[parts[4][0]] = float(value.float().reshape(()))
    incomplete = sorted(i for i, s in found.items() if set(s) != {"k", "v"})
    if incomplete:
        raise ValueError(f"--kv-scales {directory}: layer {incomplete[0]} has a k_scale or a v_scale, not both")
    if not found:
        raise ValueError(f"--kv-scales {directory}: no self_attn.k_scale / v_scale tensors")
    return KvScales({i: (s["k"], s["v"]) for i, s in found.items()}, str(directory))
