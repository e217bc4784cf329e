"""Bad checkpoints fail with an error naming the file and tensor, before any parameter is written."""

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

from beam_hpu.loader.checkpoint import CheckpointError
from beam_hpu.loader.load import load_checkpoint
from beam_hpu.loader.options import LoaderOptions
from tests.loader.toy import C, R, ToyRank, toy_tensors, write_toy_checkpoint
from tests.support.engines import run_engine

SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


def fails_untouched(directory, match):
    model = ToyRank(2, 1, True)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, directory)
    assert all((p == -7).all() for p in model.parameters()), "a parameter was written before the error"


def last_tensor(path):
    (n,) = struct.unpack("<Q", open(path, "rb").read(8))
    header = json.loads(open(path, "rb").read(8 + n)[8:])
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])


def test_truncated_shard(tmp_path):
    d = write_toy_checkpoint(tmp_path / "ck")
    shard = d / SHARD2
    tensor = last_tensor(shard)
    os.truncate(shard, shard.stat().st_size - 10)
    fails_untouched(d, rf"{shard}: truncated: tensor '{tensor}' ends at data byte")


def test_corrupt_header_json(tmp_path):
    d = write_toy_checkpoint(tmp_path / "ck")
    with open(d / SHARD1, "r+b") as f:
        f.seek(8)
        f.write(b"#not json")
    fails_untouched(d, rf"{d / SHARD1}: corrupt header: not JSON")


def test_corrupt_header_length(tmp_path):
    d = write_toy_checkpoint(tmp_path / "ck")
    with open(d / SHARD1, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))
    fails_untouched(d, rf"{d / SHARD1}: corrupt header: declares 1099511627776 header bytes")


def test_corrupt_header_byte_range(tmp_path):
    d = write_toy_checkpoint(tmp_path / "ck")
    path = d / SHARD1
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = sorted(k for k in header if k != "__metadata__")[0]
    header[name]["shape"] = [R, C + 1]  # no longer matches its byte range
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n, "the test needs the edited header to fit the original's length"
    path.write_bytes(raw[:8] + text + raw[8 + n:])
    fails_untouched(d, rf"{path}: corrupt header: tensor '{name}' \(BF16 \[8, 7\]\) has byte range")


def test_index_names_missing_shard(tmp_path):
    d = write_toy_checkpoint(tmp_path / "ck")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["norm.weight"] = "model-00003-of-00003.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    fails_untouched(d, r"names shard 'model-00003-of-00003.safetensors' \(e.g. for tensor 'norm.weight'\), which is not")


def test_duplicate_tensor_across_shards(tmp_path):
    d = write_toy_checkpoint(tmp_path / "ck")
    save_file({"norm.weight": torch.zeros(C), "extra": torch.zeros(1)}, str(d / "model-extra.safetensors"))
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["extra"] = "model-extra.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    fails_untouched(d, r"tensor 'norm.weight' is in two shards: .*model-0000\d-of-00002.safetensors and .*model-extra")


def test_dtype_not_matching_model(tmp_path):
    tensors = toy_tensors()
    tensors["col.weight"] = tensors["col.weight"].to(torch.float8_e4m3fn)  # an FP8 weight for a bf16 layer
    d = write_toy_checkpoint(tmp_path / "ck", tensors)
    fails_untouched(d, r"model-0000\d-of-00002.safetensors: tensor 'col.weight' \(float8_e4m3fn \[8, 6\]\): dtype "
                       r"torch.float8_e4m3fn does not match the model's col \(torch.bfloat16\)")


def test_shape_not_matching_model(tmp_path):
    tensors = toy_tensors()
    tensors["experts.2.up.weight"] = torch.zeros(R, C + 2, dtype=torch.bfloat16)
    d = write_toy_checkpoint(tmp_path / "ck", tensors)
    fails_untouched(d, r"tensor 'experts.2.up.weight' \(bfloat16 \[8, 8\]\): a \[8, 8\] slice does not fit w13 "
                       r"\(slot \[8, 6\]\)")


def test_unknown_tensor_names_the_file(tmp_path):
    tensors = toy_tensors()
    tensors["stray.weight"] = torch.zeros(2)
    d = write_toy_checkpoint(tmp_path / "ck", tensors)
    fails_untouched(d, r"model-0000\d-of-00002.safetensors: tensor 'stray.weight' .* does not fit the model: "
                       r"KeyError: \"no parameter for 'stray.weight'\"")


def test_extra_config_rejects_unknown_and_bad_values():
    assert LoaderOptions.from_extra_config({"num_threads": 4}).num_threads == 4
    with pytest.raises(ValueError, match=r"unknown --model-loader-extra-config key\(s\) \['num_thread'\]; known keys: "
                                         r"\['chunk_mib', 'max_gap_kib', 'max_staging_mib', 'num_threads', "
                                         r"'progress_percent'\]"):
        LoaderOptions.from_extra_config({"num_thread": 4})
    with pytest.raises(ValueError, match=r"'chunk_mib' must be an integer >= 1, got 0"):
        LoaderOptions.from_extra_config({"chunk_mib": 0})


@pytest.mark.slow
def test_engine_refuses_truncated_shard_and_unknown_option(tiny_bf16, tmp_path):
    """Through vLLM: the error reaches the user, naming file and tensor (one engine start each)."""
    d = tmp_path / "ck"
    d.mkdir()
    for f in tiny_bf16.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    shard = sorted(d.glob("*.safetensors"))[-1]
    tensor = last_tensor(shard)
    os.truncate(shard, shard.stat().st_size - 1)
    with pytest.raises(RuntimeError) as err:
        run_engine(d, [{"prompt_logprobs": [1, 2]}], dtype="bfloat16", load_format="beam", timeout=300)
    assert f"{shard}: truncated: tensor '{tensor}'" in str(err.value)
    with pytest.raises(RuntimeError) as err:
        run_engine(tiny_bf16, [{"prompt_logprobs": [1, 2]}], dtype="bfloat16", load_format="beam", timeout=300,
                   engine_kwargs={"model_loader_extra_config": {"threads": 4}})
    assert "unknown --model-loader-extra-config key(s) ['threads']" in str(err.value)
