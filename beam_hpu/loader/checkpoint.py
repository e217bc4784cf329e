"""A safetensors checkpoint directory as a table of tensors: file, dtype, shape, byte range.

Everything here is read from headers (8-byte length + JSON), never from tensor data, and checked
before any weight is read: a shard whose data is shorter than its header says (truncated), a
header that is not valid safetensors, an index naming a file that is not there, the same tensor
in two shards. Each error names the file and the tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

INDEX_NAME = "model.safetensors.index.json"

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# A header larger than this is not a safetensors header (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000


class CheckpointError(ValueError):
    """The checkpoint on disk is unusable; the message names the file (and tensor)."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: str  # absolute path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the first element in `file`
    nbytes: int

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


@dataclass
class Checkpoint:
    directory: Path
    tensors: dict[str, TensorEntry]
    header_bytes: dict[str, int]  # file -> bytes read to parse its header

    @property
    def files(self) -> list[str]:
        return sorted(self.header_bytes)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.tensors.values())


def read_header(path: str) -> tuple[dict, int]:
    """(header JSON, data start offset) of one shard, validated against the file size."""
    size = os.path.getsize(path)
    with open(path, "rb", buffering=0) as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"{path}: corrupt header: declares {n} header bytes in a {size}-byte file")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt header: not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt header: a JSON {type(header).__name__}, not an object")
    return header, 8 + n


def shard_entries(path: str) -> tuple[list[TensorEntry], int]:
    """The tensors of one shard and the header bytes read; every byte range checked."""
    header, data_start = read_header(path)
    data_len = os.path.getsize(path) - data_start
    ranges = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = DTYPES[spec["dtype"]], tuple(spec["shape"]), spec["data_offsets"]
            expected = dtype.itemsize * _numel(shape)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}: {spec!r} ({e!r})") from None
        if not (isinstance(begin, int) and isinstance(end, int)) or begin < 0 or end - begin != expected:
            raise CheckpointError(f"{path}: corrupt header: tensor {name!r} ({spec['dtype']} {list(shape)}) "
                                  f"has byte range {spec['data_offsets']}, {expected} bytes expected")
        if end > data_len:
            raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at data byte {end} but the file "
                                  f"holds only {data_len} data bytes")
        ranges.append((begin, end, name, dtype, shape))
    ranges.sort()
    for (_, prev_end, prev, *_), (begin, _, name, *_) in zip(ranges, ranges[1:]):
        if begin < prev_end:
            raise CheckpointError(f"{path}: corrupt header: tensors {prev!r} and {name!r} overlap")
    entries = [TensorEntry(name, path, dtype, shape, data_start + begin, end - begin)
               for begin, end, name, dtype, shape in ranges]
    return entries, data_start


def _numel(shape) -> int:
    n = 1
    for s in shape:
        if not isinstance(s, int) or s < 0:
            raise ValueError(f"bad dimension {s!r}")
        n *= s
    return n


def shard_files(directory: Path) -> tuple[list[str], dict[str, str] | None]:
    """Shard paths, and the index's tensor -> file map when there is an index."""
    index_path = directory / INDEX_NAME
    if not index_path.exists():
        files = sorted(str(p) for p in directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors files and no {INDEX_NAME}")
        return files, None
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_path}: not a safetensors index ({e!r})") from None
    files = sorted(set(weight_map.values()))
    for f in files:
        if not (directory / f).is_file():
            tensor = next(n for n, v in weight_map.items() if v == f)
            raise CheckpointError(f"{index_path}: names shard {f!r} (e.g. for tensor {tensor!r}), "
                                  f"which is not in {directory}")
    return [str(directory / f) for f in files], weight_map


def open_checkpoint(directory: str | Path) -> Checkpoint:
    """Read and check every shard header of a checkpoint directory (no tensor data is read)."""
    directory = Path(directory).resolve()
    files, weight_map = shard_files(directory)
    tensors: dict[str, TensorEntry] = {}
    header_bytes: dict[str, int] = {}
    for path in files:
        entries, header_bytes[path] = shard_entries(path)
        for e in entries:
            if e.name in tensors:
                raise CheckpointError(f"tensor {e.name!r} is in two shards: {tensors[e.name].file} and {path}")
            tensors[e.name] = e
    if weight_map is not None:
        for name, f in weight_map.items():
            if name not in tensors:
                raise CheckpointError(f"{directory / INDEX_NAME}: maps tensor {name!r} to {f!r}, "
                                      f"but that shard's header does not have it")
            if Path(tensors[name].file).name != f:
                raise CheckpointError(f"{directory / INDEX_NAME}: maps tensor {name!r} to {f!r}, "
                                      f"but it is in {tensors[name].file}")
    return Checkpoint(directory, tensors, header_bytes)


def write_shards(sd: dict, out: Path, num_shards: int, metadata: dict | None = None) -> list[str]:
    """Write `sd` as the layout this module reads: `num_shards` safetensors files in name order
    (a layer's tensors stay together) and the index naming each tensor's file."""
    from safetensors.torch import save_file

    names = list(sd)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    per_shard = math.ceil(total / num_shards)
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = sd[name].numel() * sd[name].element_size()
        if shards[-1] and size + nbytes > per_shard and len(shards) < num_shards:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files, weight_map = [], {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: sd[n].contiguous() for n in shard}, str(out / fname), metadata={"format": "pt", **(metadata or {})})
        files.append(fname)
        weight_map.update({n: fname for n in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return files
