"""`beam-hpu reference`: the layer-streaming reference writes the in-memory reference's file, resumes,
never uses a bad workdir file, and refuses bad input before reading a weight."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from beam_hpu.cli import main as cli
from beam_hpu.gates.profile import get_profile
from beam_hpu.loader.checkpoint import CheckpointError
from beam_hpu.reference import layer_stream
from beam_hpu.reference import streamed as streamed_reference
from beam_hpu.reference.file_format import FORMAT
from beam_hpu.reference.live import live_reference
from beam_hpu.reference.plan import Passage, make_plan, read_passages
from beam_hpu.reference.workdir import WorkdirError
from tests.quant import broken_checkpoints as broken

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 512  # the tiny Beam's


@pytest.fixture(scope="module")
def passages() -> dict:
    """Two passages longer than the tiny Beam's window (16), one with scored flags."""
    g = torch.Generator().manual_seed(0)
    short, long = (torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (40, 70))
    return {"short": short, "long": {"token_ids": long, "scored": [0] + [int(i % 3 != 0) for i in range(1, 70)]}}


@pytest.fixture(scope="module")
def passages_file(tmp_path_factory, passages) -> Path:
    path = tmp_path_factory.mktemp("passages") / "passages.json"
    path.write_text(json.dumps(passages))
    return path


def as_live(passages: dict) -> dict:
    return {n: (v["token_ids"], v["scored"]) if isinstance(v, dict) else v for n, v in passages.items()}


def profile(dtype: str):
    return get_profile("gaudi", reference_dtype=dtype)


def write_streamed_reference(*args, **kwargs):
    """The streamed reference with the gaudi profile's bars, as `beam-hpu reference` writes it."""
    kwargs.setdefault("profile", get_profile("gaudi"))
    return streamed_reference.write_streamed_reference(*args, **kwargs)


_LIVE = {}


def in_memory(checkpoint: Path, passages: dict, dtype: str) -> dict:
    key = (str(checkpoint), dtype)
    if key not in _LIVE:
        _LIVE[key] = live_reference(checkpoint, as_live(passages), 20, profile(dtype))
    return _LIVE[key]


def streamed(checkpoint, passages_file, out: Path, dtype: str, *extra) -> dict:
    assert cli(["reference", str(checkpoint), "--passages", str(passages_file), "--out", str(out),
                "--dtype", dtype, *extra]) == 0
    return json.loads(out.read_text())


def assert_same_file(ours: dict, theirs: dict, exact_ties_only: bool = False) -> None:
    """Same fields, same top-1 and top-k ids, logprobs within 1e-5, same floors. With bf16 logits,
    two tokens can tie exactly; which of them a top-k lists first is arbitrary, so there (only)
    the order may differ."""
    assert {k: v for k, v in ours.items() if k != "passages"} == {k: v for k, v in theirs.items() if k != "passages"}
    assert ours["format"] == FORMAT
    for a, b in zip(ours["passages"], theirs["passages"], strict=True):
        assert (a["name"], a["token_ids"], a.get("scored")) == (b["name"], b["token_ids"], b.get("scored"))
        assert a["floor_top1"] == b["floor_top1"]
        for i in range(1, len(a["token_ids"])):
            assert a["token_logprobs"][i] == pytest.approx(b["token_logprobs"][i], abs=1e-5)
            va, vb = [v for _, v in a["topk"][i]], [v for _, v in b["topk"][i]]
            assert va == pytest.approx(vb, abs=1e-5)
            ia, ib = [t for t, _ in a["topk"][i]], [t for t, _ in b["topk"][i]]
            if exact_ties_only:
                # each position's ids may differ only inside a run of equal values
                for j in range(len(ia)):
                    if ia[j] != ib[j]:
                        assert vb.count(vb[j]) > 1, (a["name"], i, j)
                        assert ia[j] in [t for t, v in b["topk"][i] if v == vb[j]]
            else:
                assert ia == ib and a["top1"][i] == b["top1"][i], (a["name"], i)


@pytest.mark.parametrize("kind,dtype", [("fp8", "float32"), ("bf16", "float32"), ("fp8", "bfloat16")])
def test_streamed_file_equals_the_in_memory_reference(tiny_pair, passages, passages_file, tmp_path, kind, dtype):
    checkpoint = tiny_pair[1] if kind == "fp8" else tiny_pair[0]
    ours = streamed(checkpoint, passages_file, tmp_path / "ref.json", dtype)
    assert_same_file(ours, in_memory(checkpoint, passages, dtype), exact_ties_only=dtype == "bfloat16")
    assert 0.0 < ours["passages"][0]["floor_top1"] < 1.0  # the floor model really differs


def test_streamed_file_follows_the_rounding_switch_as_the_live_reference_does(tiny_pair, passages, passages_file,
                                                                               tmp_path, monkeypatch):
    """BEAM_EXACT_ROUNDING=1: the stream rounds as the reference does and still writes the in-memory
    file; the two roundings are different references, and the file says which it is."""
    checkpoint = tiny_pair[1]
    fast = streamed(checkpoint, passages_file, tmp_path / "fast.json", "float32")
    monkeypatch.setenv("BEAM_EXACT_ROUNDING", "1")
    exact = streamed(checkpoint, passages_file, tmp_path / "exact.json", "float32")
    assert_same_file(exact, live_reference(checkpoint, as_live(passages), 20, profile("float32")))
    assert "BEAM_EXACT_ROUNDING=1" in exact["reference"] and "BEAM_EXACT_ROUNDING=0" in fast["reference"]
    diff = max(abs(x - y) for x, y in zip(exact["passages"][1]["token_logprobs"][1:],
                                          fast["passages"][1]["token_logprobs"][1:]))
    assert diff > 0.0


def test_gaudi_range_is_a_different_reference(tiny_pair, passages, tmp_path):
    """--fp8-max 240 rounds on Gaudi 2's grid: other numbers, and the file says so."""
    ps = [Passage("short", passages["short"])]
    a = write_streamed_reference(tiny_pair[1], ps, tmp_path / "a.json", dtype=torch.float32, fp8_max=240.0)
    b = write_streamed_reference(tiny_pair[1], ps, tmp_path / "b.json", dtype=torch.float32)
    assert a["reference"].endswith("fp8_max 240, float32") and "fp8_max" not in b["reference"]
    diff = max(abs(x - y) for x, y in zip(a["passages"][0]["token_logprobs"][1:], b["passages"][0]["token_logprobs"][1:]))
    assert diff > 1e-4


def test_stopped_after_layer_k_and_resumed_writes_the_same_file(tiny_pair, passages, passages_file, tmp_path, caplog):
    checkpoint = tiny_pair[1]
    whole = streamed(checkpoint, passages_file, tmp_path / "whole.json", "float32")
    out, work = tmp_path / "ref.json", tmp_path / "work"
    ps = read_passages(passages_file)
    done = []
    assert write_streamed_reference(checkpoint, ps, out, dtype=torch.float32, workdir=work, stop_after_layer=2,
                                    on_layer=lambda i, *_: done.append(i)) is None
    assert done == [0, 1, 2] and not out.exists()
    assert sorted(p.name for p in work.glob("layer-*")) == ["layer-0001.safetensors", "layer-0002.safetensors"]
    with caplog.at_level(logging.INFO, logger="vllm.beam_hpu.reference"):
        doc = write_streamed_reference(checkpoint, ps, out, dtype=torch.float32, workdir=work,
                                       on_layer=lambda i, *_: done.append(i))
    assert done == [0, 1, 2, 3, 4, 5]  # the resumed run computed only the missing layers
    assert doc == whole == json.loads(out.read_text())
    assert any("resuming" in r.message and "after layer 2" in r.message for r in caplog.records)
    assert any("layer 6/6 (MoE)" in r.message and "ETA" in r.message for r in caplog.records)


def test_killed_run_resumes_to_the_same_file(tiny_pair, passages_file, tmp_path):
    """A real SIGKILL of the command, as soon as its first layer file is on disk."""
    checkpoint, out, work = tiny_pair[1], tmp_path / "ref.json", tmp_path / "work"
    whole = streamed(checkpoint, passages_file, tmp_path / "whole.json", "float32")
    cmd = [sys.executable, "-m", "beam_hpu.cli", "reference", str(checkpoint), "--passages", str(passages_file),
           "--out", str(out), "--dtype", "float32", "--workdir", str(work)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while proc.poll() is None and not (work / "layer-0000.safetensors").exists():
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL  # it was killed, not finished
    assert not out.exists()
    done = []
    doc = write_streamed_reference(checkpoint, read_passages(passages_file), out, dtype=torch.float32, workdir=work,
                                   on_layer=lambda i, *_: done.append(i))
    assert done and done[0] >= 1 and done[-1] == 5
    assert doc == whole


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_layer_file_is_recomputed_never_used(tiny_pair, passages_file, tmp_path, caplog, damage):
    checkpoint, out, work = tiny_pair[1], tmp_path / "ref.json", tmp_path / "work"
    ps = read_passages(passages_file)
    whole = write_streamed_reference(checkpoint, ps, tmp_path / "whole.json", dtype=torch.float32)
    write_streamed_reference(checkpoint, ps, out, dtype=torch.float32, workdir=work, stop_after_layer=3)
    victim = work / "layer-0003.safetensors"
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[-100] ^= 0x01  # one bit of one hidden state
    else:
        data = data[: len(data) - 1000]
    victim.write_bytes(bytes(data))
    done = []
    with caplog.at_level(logging.WARNING, logger="vllm.beam_hpu.reference"):
        doc = write_streamed_reference(checkpoint, ps, out, dtype=torch.float32, workdir=work,
                                       on_layer=lambda i, *_: done.append(i))
    assert done == [3, 4, 5]  # from the layer-2 file, the one before the damaged one
    assert any("layer-0003.safetensors is unusable" in r.message for r in caplog.records)
    assert doc == whole


def test_a_workdir_of_another_run_is_refused(tiny_pair, passages, tmp_path):
    work = tmp_path / "work"
    write_streamed_reference(tiny_pair[1], [Passage("short", passages["short"])], tmp_path / "a.json",
                             dtype=torch.float32, workdir=work, stop_after_layer=0)
    with pytest.raises(WorkdirError, match="another checkpoint, passages or options"):
        write_streamed_reference(tiny_pair[1], [Passage("short", passages["short"][:-1])], tmp_path / "a.json",
                                 dtype=torch.float32, workdir=work)


def test_each_routed_expert_is_read_once_per_moe_layer_in_groups(tiny_pair, passages, tmp_path, monkeypatch):
    """Bytes read per layer are exactly its own tensors and those of the experts some token is routed
    to, each once, with the experts coming in groups of two (the group bound made small here; the
    next group is read while one computes). One short passage leaves some expert unused somewhere."""
    checkpoint = tiny_pair[1]
    ps = [Passage("short", passages["short"][:24])]
    whole = write_streamed_reference(checkpoint, ps, tmp_path / "a.json", dtype=torch.float32)
    plan = make_plan(checkpoint, ps, torch.float32)
    expert_bytes = sum(e.nbytes for e in plan.expert_entries(1, 0))
    monkeypatch.setattr(layer_stream, "EXPERT_GROUP_BYTES", 2 * expert_bytes)
    groups = []
    real = layer_stream.expert_groups
    monkeypatch.setattr(layer_stream, "expert_groups", lambda *a, **k: groups.append(real(*a, **k)) or groups[-1])
    read = {}
    doc = write_streamed_reference(checkpoint, ps, tmp_path / "b.json", dtype=torch.float32,
                                   on_layer=lambda i, s, n: read.__setitem__(i, n))
    assert doc == whole
    moe = [i for i in read if plan.is_moe(i)]
    assert len(groups) == len(moe)
    assert any(sum(map(len, g)) < plan.config.num_experts for g in groups)
    for i in read:
        expected = sum(e.nbytes for e in plan.layer_entries(i))
        if plan.is_moe(i):
            g = groups[moe.index(i)]
            used = [x for group in g for x in group]
            assert used == sorted(set(used)) and len(g) > 1 and all(len(group) <= 2 for group in g)
            expected += sum(e.nbytes for x in used for e in plan.expert_entries(i, x))
        assert read[i] == expected, i


def test_bad_token_id_is_refused_before_any_work(tiny_pair, passages, tmp_path):
    ids = list(passages["short"])
    ids[7] = VOCAB
    out = tmp_path / "ref.json"
    with pytest.raises(ValueError, match=r"passage 'bad': token id 512 at position 7 is outside the vocabulary"):
        write_streamed_reference(tiny_pair[1], [Passage("bad", ids)], out)
    assert not out.exists() and not (tmp_path / "ref.json.work").exists()


def test_bad_scored_flags_are_refused_before_any_work(tiny_pair, passages, tmp_path):
    with pytest.raises(ValueError, match="'scored' needs one flag per token"):
        write_streamed_reference(tiny_pair[1], [Passage("s", passages["short"], [0] * 40)], tmp_path / "r.json")


@pytest.mark.parametrize("kind,victim", [
    ("fp8", "model.layers.3.mlp.experts.5.up_proj.weight"),
    ("bf16", "model.layers.2.post_feedforward_layernorm.weight"),
    ("fp8", "model.norm.weight"),
])
def test_missing_tensor_is_refused_before_any_work(tiny_pair, passages, tmp_path, kind, victim):
    src = tiny_pair[1] if kind == "fp8" else tiny_pair[0]
    bad = broken.missing_scale(src, tmp_path / "bad", victim)
    out = tmp_path / "ref.json"
    with pytest.raises(CheckpointError, match=r"tensor '" + victim.replace(".", r"\.") + "'.* is missing"):
        write_streamed_reference(bad, [Passage("short", passages["short"])], out)
    assert not (tmp_path / "ref.json.work").exists()


def test_missing_scale_is_refused_before_any_work(tiny_pair, passages, tmp_path):
    bad = broken.missing_scale(tiny_pair[1], tmp_path / "bad")
    with pytest.raises(ValueError, match=r"o_proj matches the quantization config but has no weight_scale"):
        write_streamed_reference(bad, [Passage("short", passages["short"])], tmp_path / "ref.json")
    assert not (tmp_path / "ref.json.work").exists()


def test_fp8_max_on_an_unquantised_checkpoint_is_refused(tiny_pair, passages_file, tmp_path):
    with pytest.raises(ValueError, match=r"--fp8-max 240: .*config.json has no quantization_config"):
        cli(["reference", str(tiny_pair[0]), "--passages", str(passages_file), "--out", str(tmp_path / "r.json"),
             "--fp8-max", "240"])
    assert not (tmp_path / "r.json.work").exists()


def test_passages_file_errors_name_the_file_and_passage(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"x": [1, 2, "3"]}))
    with pytest.raises(ValueError, match=r"p\.json: passage 'x': token ids must be a list of integers"):
        read_passages(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        read_passages(bad)


def test_text_files_are_passages_tokenized_with_the_checkpoint_tokenizer(tiny_pair, tmp_path):
    from transformers import AutoTokenizer

    text = tmp_path / "paris.txt"
    text.write_text("the model reads a passage and writes an answer . hello world , numbers 1 2 3 42 100")
    ids = AutoTokenizer.from_pretrained(str(tiny_pair[1]))(text.read_text(), add_special_tokens=False).input_ids
    (tmp_path / "p.json").write_text(json.dumps({"paris": ids}))
    a = streamed(tiny_pair[1], tmp_path / "p.json", tmp_path / "a.json", "float32")
    assert cli(["reference", str(tiny_pair[1]), "--text", str(text), "--out", str(tmp_path / "b.json"),
                "--dtype", "float32"]) == 0
    assert json.loads((tmp_path / "b.json").read_text()) == a and a["passages"][0]["token_ids"] == ids
