"""The resumable state of a layer-streaming reference run (`beam_hpu.reference.streamed`).

A workdir holds
  run.json                   what the run computes: a fingerprint of the checkpoint's tensor table
                             and config, the passages and the options. A workdir started for
                             another run is refused (not overwritten: it may be hours of work).
  layer-NNNN.safetensors     every stream's hidden states for every passage after layer NNNN,
                             with the run's fingerprint, the layer and a SHA-256 of the tensors
                             in the safetensors metadata.
Files are written to a temporary name and renamed, so a kill leaves either the whole file or none;
a file that is truncated, fails its checksum or belongs to another run is deleted and its layer
recomputed from the newest file before it that checks out. The newest two layer files are kept (a
corrupt newest file then costs one layer, not the run); older ones are removed as the run moves on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

import torch

WORK_FORMAT = "beam-streamed-reference-work/1"
RUN_FILE = "run.json"
KEEP_LAYER_FILES = 2
_LAYER_FILE = re.compile(r"^layer-(\d{4})\.safetensors$")

logger = logging.getLogger("vllm.beam_hpu.reference")


class WorkdirError(ValueError):
    """The workdir belongs to another run; the message names it."""


def fingerprint(description: dict) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def layer_file(directory: Path, layer: int) -> Path:
    return directory / f"layer-{layer:04d}.safetensors"


class Workdir:
    def __init__(self, directory: str | Path, description: dict):
        self.directory = Path(directory)
        self.fingerprint = fingerprint(description)
        self.directory.mkdir(parents=True, exist_ok=True)
        run = self.directory / RUN_FILE
        if run.exists():
            try:
                saved = json.loads(run.read_text())["fingerprint"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise WorkdirError(f"{run}: not a {WORK_FORMAT} run file ({e!r}); remove {self.directory} "
                                   f"or pass another --workdir") from None
            if saved != self.fingerprint:
                raise WorkdirError(f"{self.directory} holds a run of another checkpoint, passages or options "
                                   f"(see {run}); remove it or pass another --workdir")
        else:
            atomic_write(run, (json.dumps({"format": WORK_FORMAT, "fingerprint": self.fingerprint,
                                            "run": description}, indent=1) + "\n").encode())
        for stale in self.directory.glob("*.tmp-*"):  # a write the last run was killed in
            stale.unlink()

    def layers(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := _LAYER_FILE.match(p.name)))

    def resume(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """(layer, states) of the newest layer file that checks out, or None; bad files are deleted."""
        for layer in reversed(self.layers()):
            path = layer_file(self.directory, layer)
            try:
                return layer, self._load(path, layer)
            except Exception as e:  # noqa: BLE001 -- any unreadable file is recomputed, never used
                logger.warning("%s is unusable (%s); deleting it and recomputing layer %d", path, e, layer)
                path.unlink()
        return None

    def _load(self, path: Path, layer: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        from beam_hpu.loader.checkpoint import read_header

        meta = read_header(str(path))[0].get("__metadata__") or {}
        if meta.get("format") != WORK_FORMAT or meta.get("fingerprint") != self.fingerprint \
                or meta.get("layer") != str(layer):
            raise ValueError("written by another run or for another layer")
        tensors = load(path.read_bytes())
        if tensors_sha256(tensors) != meta.get("sha256"):
            raise ValueError("checksum mismatch")
        return tensors

    def save(self, layer: int, states: dict[str, torch.Tensor]) -> Path:
        from safetensors.torch import save

        states = {n: t.contiguous() for n, t in states.items()}
        meta = {"format": WORK_FORMAT, "fingerprint": self.fingerprint, "layer": str(layer),
                "sha256": tensors_sha256(states)}
        path = layer_file(self.directory, layer)
        atomic_write(path, save(states, metadata=meta))
        for old in self.layers()[:-KEEP_LAYER_FILES]:
            layer_file(self.directory, old).unlink()
        return path


def atomic_write(path: Path, data: bytes) -> None:
    """`data` at `path`, whole or not at all (a temp file, fsynced, renamed over it)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
