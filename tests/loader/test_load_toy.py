"""The loader on a toy TP/EP rank (no engine): same state as feeding every tensor to the model's
own loader, only this rank's bytes read (counted at the preadv call), no mmap, one device
hand-over per parameter, and the whole-model check."""

import mmap

import pytest
import torch
from safetensors.torch import load_file

from beam_hpu.loader import place, reader
from beam_hpu.loader.checkpoint import CheckpointError
from beam_hpu.loader.load import load_checkpoint
from beam_hpu.loader.options import LoaderOptions
from tests.loader.toy import ToyRank, state_bytes, toy_tensors, write_toy_checkpoint

RANKS = [(1, 0, False), (2, 0, False), (2, 1, False), (2, 0, True), (2, 1, True), (4, 3, True)]


@pytest.fixture
def toy_dir(tmp_path):
    return write_toy_checkpoint(tmp_path / "toy")


def reference(tp, rank, ep, directory):
    model = ToyRank(tp, rank, ep)
    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    model.load_weights(tensors.items())
    return model


@pytest.fixture
def counted_reads(monkeypatch):
    """Bytes actually requested from the kernel, counted at os.preadv; mmap forbidden."""
    counts = {"bytes": 0, "calls": 0}
    real = reader.os.preadv

    def preadv(fd, buffers, offset):
        n = real(fd, buffers, offset)
        counts["bytes"] += n
        counts["calls"] += 1
        return n

    def no_mmap(*a, **k):
        raise AssertionError("the loader must not mmap shards")

    monkeypatch.setattr(reader.os, "preadv", preadv)
    monkeypatch.setattr(mmap, "mmap", no_mmap)
    return counts


@pytest.mark.parametrize("tp,rank,ep", RANKS)
def test_same_state_as_model_loader_and_only_own_bytes(toy_dir, counted_reads, tp, rank, ep):
    """With gap reads off, the kernel is asked for exactly this rank's bytes."""
    model = ToyRank(tp, rank, ep)
    report = load_checkpoint(model, toy_dir, LoaderOptions(num_threads=3, chunk_mib=1, max_gap_kib=0))
    assert state_bytes(model) == state_bytes(reference(tp, rank, ep, toy_dir))
    assert counted_reads["bytes"] == report.data_bytes == model.expected_bytes()
    assert report.gap_bytes == 0


@pytest.mark.parametrize("tp,rank,ep", RANKS[1:])
def test_gap_reads_are_counted_apart_and_change_nothing(toy_dir, counted_reads, tp, rank, ep):
    """By default short holes (a row-parallel slice's other columns) are read over, not skipped
    call by call; those bytes are counted as gap bytes, and the state is the same."""
    model = ToyRank(tp, rank, ep)
    report = load_checkpoint(model, toy_dir, LoaderOptions(num_threads=3, chunk_mib=1))
    assert state_bytes(model) == state_bytes(reference(tp, rank, ep, toy_dir))
    assert report.data_bytes == model.expected_bytes()
    assert counted_reads["bytes"] == report.data_bytes + report.gap_bytes
    assert 0 < report.gap_bytes


def test_reads_are_joined_when_adjacent_and_split_when_long():
    mv = memoryview(bytearray(16))
    requests = [reader.ReadRequest("a", 0, mv[0:10]), reader.ReadRequest("a", 10, mv[10:12]),
                reader.ReadRequest("a", 20, mv[12:14]), reader.ReadRequest("b", 12, mv[14:16])]
    calls = reader._calls(requests, chunk_bytes=4)
    assert [(f, off, [len(b) for b in bufs], gap) for f, off, bufs, gap in calls] == [
        ("a", 0, [4], 0), ("a", 4, [4], 0), ("a", 8, [2, 2], 0), ("a", 20, [2], 0), ("b", 12, [2], 0)]
    # A hole of up to max_gap bytes is read into the scratch buffer instead of starting a call.
    calls = reader._calls(requests, chunk_bytes=32, max_gap=8, gap_buffer=memoryview(bytearray(8)))
    assert [(f, off, [len(b) for b in bufs], gap) for f, off, bufs, gap in calls] == [
        ("a", 0, [10, 2, 8, 2], 8), ("b", 12, [2], 0)]


def test_device_parameters_are_staged_and_handed_over_once(toy_dir, monkeypatch):
    """Where parameters are not host memory (HPU), each is filled in one host staging tensor and
    copied over once: the 2 local experts' gate and up rows arrive as one w13 copy."""
    monkeypatch.setattr(place, "needs_staging", lambda param: True)
    model = ToyRank(2, 0, True)
    whole = {p.untyped_storage().data_ptr(): (n, p.numel()) for n, p in model.named_parameters()}
    copies = []
    real_copy = torch.Tensor.copy_

    def counting_copy(self, src, *args, **kwargs):
        name, numel = whole.get(self.untyped_storage().data_ptr(), (None, -1))
        if name and self.numel() == numel and not src.is_meta:  # meta: the probe, which copies nothing
            copies.append(name)
        return real_copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
    load_checkpoint(model, toy_dir)
    monkeypatch.undo()
    assert sorted(copies) == sorted(n for n, _ in model.named_parameters())
    assert state_bytes(model) == state_bytes(reference(2, 0, True, toy_dir))


def test_missing_tensor_is_named_before_anything_is_written(tmp_path):
    tensors = toy_tensors()
    del tensors["experts.1.up.weight"]
    directory = write_toy_checkpoint(tmp_path / "missing", tensors)
    model = ToyRank(2, 0, True)
    with pytest.raises(CheckpointError, match=r"w13 \[2, 16, 6\]: 48 of 192 elements not in any checkpoint tensor"):
        load_checkpoint(model, directory)
    assert all((p == -7).all() for p in model.parameters()), "a parameter was written before the error"


def test_tensor_loaded_twice_is_named(tmp_path):
    class Twice(ToyRank):
        def load_weights(self, weights):
            out = super().load_weights(weights)
            for name, t in weights if isinstance(weights, list) else []:
                if name == "experts.0.gate.weight":
                    self.w13.data[0].narrow(0, R0, R0).copy_(t)  # lands on up's rows too
            return out

    from tests.loader.toy import R as R0
    directory = write_toy_checkpoint(tmp_path / "twice")
    with pytest.raises(CheckpointError, match=r"w13: 48 elements written more than once, by \['experts.0.gate.weight', 'experts.0.up.weight'\]"):
        load_checkpoint(Twice(2, 0, True), directory)


def test_optional_parameters_may_stay_unloaded_but_nothing_else(tmp_path):
    """KV-cache scales are the kind of parameter vLLM defaults when a checkpoint has none."""
    tensors = toy_tensors()
    del tensors["norm.weight"]
    directory = write_toy_checkpoint(tmp_path / "no-norm", tensors)
    model = ToyRank(2, 0, True)
    load_checkpoint(model, directory, optional=frozenset({"norm"}))
    assert (model.norm == -7).all()
    with pytest.raises(CheckpointError, match=r"norm \[6\]: 6 of 6 elements not in any checkpoint tensor"):
        load_checkpoint(ToyRank(2, 0, True), directory, optional=frozenset({"cast"}))
