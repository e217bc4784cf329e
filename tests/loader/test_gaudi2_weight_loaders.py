"""`--load-format beam` loads the tiny FP8 Beam through Gaudi 2's FP8 weight loaders
(tests/support/gaudi2_weights.py: FP8 weights halved, their scales doubled) to the state vLLM's
stock loader leaves through the same loaders, bit for bit. Those loaders compute on the checkpoint
tensor instead of copying a view of it, so the probe cannot place it: it replays each such tensor
through the real loader. The models are built and loaded in one fresh process, no engine."""

import json
import sys

import pytest
import torch

from tests.support.engines import cpu_env, run_in_group

RUNS = [["stock", "auto", False], ["stock-gaudi2", "auto", True], ["beam-gaudi2", "beam", True]]


@pytest.fixture(scope="module")
def loads(tiny_fp8, tmp_path_factory):
    d = tmp_path_factory.mktemp("gaudi2-loads")
    (d / "spec.json").write_text(json.dumps({"model": str(tiny_fp8), "runs": RUNS}))
    proc = run_in_group([sys.executable, "-m", "tests.support.inprocess_load", str(d / "spec.json"), str(d / "out.pt")],
                        timeout=600, env=cpu_env(1))
    assert proc.returncode == 0, proc.stdout[-4000:]
    return torch.load(d / "out.pt")


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bytes, not values: NaN != NaN and -0.0 == 0.0 would hide or invent differences.
    return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                    b.reshape(-1).view(torch.uint8))


def test_beam_leaves_the_stock_state_through_gaudi2_loaders(loads):
    stock, beam = loads["stock-gaudi2"]["state"], loads["beam-gaudi2"]["state"]
    assert sorted(stock) == sorted(beam)
    assert [name for name in stock if not same_bytes(stock[name], beam[name])] == []


def test_the_gaudi2_loaders_halve_every_fp8_weight_and_double_its_scale(loads):
    """What makes the comparison above about the wrapped loaders: they changed every FP8 weight and
    its scale, and nothing else."""
    plain, gaudi2 = loads["stock"]["state"], loads["stock-gaudi2"]["state"]
    fp8 = {name for name, t in plain.items() if t.dtype == torch.float8_e4m3fn}
    scales = {name for name in plain if name.endswith("weight_scale")}
    assert len(fp8) == len(scales) >= 20
    for name in fp8:
        assert same_bytes(gaudi2[name], (plain[name].float() / 2).to(torch.float8_e4m3fn)), name
    for name in scales:
        assert same_bytes(gaudi2[name], plain[name] * 2), name
    assert [name for name in plain if name not in fp8 | scales and not same_bytes(plain[name], gaudi2[name])] == []


def test_the_probe_replays_what_the_gaudi2_loaders_compute_on(loads):
    plans = loads["beam-gaudi2"]["plans"]
    computed = {name for name in plans if name.endswith(("proj.weight", "proj.weight_scale"))
                and ".mlp.gate." not in name}
    assert computed and {plans[name] for name in computed} == {"replay"}
    assert {plans[name] for name in plans if name.endswith(("norm.weight", "embed_tokens.weight"))} == {"place"}
