"""Expert parallel on CPU: TP=2 + --enable-expert-parallel serves the same logprobs as TP=1, and each
rank holds only its own experts. Unquantised experts run vLLM-CPU's kernel through
`beam_hpu.cpu_expert_parallel`; FP8 experts run `beam_hpu.quant.portable_fp8_moe`.

Bounds (max |delta logprob| over every prompt position of two prompts, 200 and ~130 tokens):
- fp32 serving (unquantised and FP8): 1e-4, the bound of TP=2 without EP (test_model_vs_oracle).
  Only the order of the cross-rank sum differs from TP=1; for FP8 the well-conditioned tiny model
  keeps that from flipping a per-token FP8 rounding into a visible jump.
- bf16 serving: 0.05, the bf16 decode-vs-prefill bound of test_model_vs_oracle: each layer's
  two partial sums are rounded to bf16 before the all-reduce.
The bound a wrong expert id would break is far larger: tests/unit/test_cpu_expert_parallel.py
(real kernel) and tests/quant/test_portable_fp8_moe.py show a mis-mapped expert moves the layer
output by > 1e-2, which the full model turns into logprob changes of order 0.1-1.
"""

import pytest
import torch

from beam_hpu.quant.fp8_checkpoint import BEAM_FP8_IGNORE, load_checkpoint_tensors, quantize_checkpoint
from beam_hpu.tiny import CONDITIONED_POST_NORM_GAIN, write_tiny_checkpoint
from tests.support.engines import max_abs_delta, mean_abs_delta, run_engine
from tests.test_model_vs_oracle import prompts

pytestmark = pytest.mark.slow

NUM_EXPERTS, MOE_LAYERS, WORLD = 8, 5, 2  # the "small" preset: 8 experts, layers 1..5 sparse


@pytest.fixture(scope="module")
def bf16_conditioned(tmp_path_factory):
    """bf16 serving needs the well-conditioned tiny model (see beam_hpu.tiny.CONDITIONED_POST_NORM_GAIN):
    on the default one, bf16 rounding alone flips experts and logprobs move by whole nats."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ep-bf16"), "small",
                                 post_norm_gain=CONDITIONED_POST_NORM_GAIN)


@pytest.fixture(scope="module")
def fp8_conditioned(bf16_conditioned, tmp_path_factory):
    return quantize_checkpoint(bf16_conditioned, tmp_path_factory.mktemp("ep-fp8"))


def checkpoint_expert_fingerprints(model_dir) -> dict[tuple[int, int], float]:
    """(layer, global expert id) -> sum of its dequantised down_proj weights, from the files."""
    tensors = load_checkpoint_tensors(model_dir)
    sums = {}
    for name, w in tensors.items():
        if ".mlp.experts." in name and name.endswith("down_proj.weight"):
            parts = name.split(".")
            layer, expert = int(parts[2]), int(parts[5])
            scale = tensors.get(name + "_scale")
            w = w.float() * (scale.float() if scale is not None else 1.0)
            sums[(layer, expert)] = w.sum().item()
    return sums


def assert_each_rank_holds_only_its_experts(ranks, model_dir):
    """Rank r holds exactly experts [r*E/2, (r+1)*E/2) of every MoE layer, and their weights are
    those experts' checkpoint weights (not another expert's, not zeros)."""
    fingerprints = checkpoint_expert_fingerprints(model_dir)
    assert len(ranks) == WORLD
    per = NUM_EXPERTS // WORLD
    for rank, layers in enumerate(ranks):
        assert len(layers) == MOE_LAYERS
        for name, info in layers.items():
            layer = int(name.split(".")[2])
            assert info["ep_rank"] == rank
            assert info["local"] == per, (name, info)
            assert info["global_ids"] == list(range(rank * per, (rank + 1) * per)), (name, info)
            expected = [fingerprints[(layer, g)] for g in info["global_ids"]]
            assert info["w2_sums"] == pytest.approx(expected, rel=1e-3, abs=1e-3), name


def run_pair(model_dir, dtype, control=False):
    """TP=1 and TP=2+EP on the same prompts; with `control`, also TP=2 without EP. Returns
    ({run: (max, mean) |delta logprob| vs TP=1 over all positions}, TP=2+EP expert inventory)."""
    ps = prompts(model_dir)
    jobs = [{"prompt_logprobs": p} for p in ps]
    tp1 = run_engine(model_dir, jobs, dtype=dtype, max_model_len=512)
    *tp2ep, inventory = run_engine(model_dir, jobs + [{"experts": True}], dtype=dtype, tp=2, ep=True,
                                   max_model_len=512)
    runs = {"tp2+ep": tp2ep}
    if control:
        runs["tp2"] = run_engine(model_dir, jobs, dtype=dtype, tp=2, max_model_len=512)
    flat = lambda results: [x for r in results for x in r["prompt_logprobs"]]  # noqa: E731
    deltas = {name: (max_abs_delta(flat(tp1), flat(r)), mean_abs_delta(flat(tp1), flat(r))) for name, r in runs.items()}
    print(f"{model_dir.name} {dtype}: |delta logprob| vs TP1 (max, mean): {deltas}")
    return deltas, inventory["ranks"]


def assert_ep_adds_nothing_to_tp(deltas):
    """Where TP=2 itself cannot match TP=1 exactly (bf16 partial sums, FP8 per-shard activation
    scales), expert parallel must not add to TP's own deviation; a mis-mapped expert would (its
    deviation is of order 1, see the module docstring)."""
    (ep_max, ep_mean), (tp_max, tp_mean) = deltas["tp2+ep"], deltas["tp2"]
    assert ep_mean <= 2 * tp_mean + 1e-3
    assert ep_mean <= 0.05


def test_unquantised_tp2_ep_matches_tp1_fp32(tiny_fp32):
    deltas, ranks = run_pair(tiny_fp32, "float32")
    assert deltas["tp2+ep"][0] <= 1e-4
    assert_each_rank_holds_only_its_experts(ranks, tiny_fp32)
    assert {info["dtype"] for layers in ranks for info in layers.values()} == {"float32"}


def test_unquantised_tp2_ep_matches_tp1_bf16(bf16_conditioned):
    deltas, ranks = run_pair(bf16_conditioned, "bfloat16", control=True)
    assert_ep_adds_nothing_to_tp(deltas)
    assert_each_rank_holds_only_its_experts(ranks, bf16_conditioned)
    assert {info["dtype"] for layers in ranks for info in layers.values()} == {"bfloat16"}


@pytest.fixture(scope="module")
def fp8_experts_only(bf16_conditioned, tmp_path_factory):
    """Only the experts in FP8: attention and the dense MLP stay unquantised (see test below)."""
    ignore = BEAM_FP8_IGNORE + ["re:.*self_attn[.].*", "re:.*mlp[.](gate|up|down)_proj$"]
    return quantize_checkpoint(bf16_conditioned, tmp_path_factory.mktemp("ep-fp8-experts"), ignore=ignore)


def test_fp8_experts_tp2_ep_matches_tp1(fp8_experts_only):
    deltas, ranks = run_pair(fp8_experts_only, "float32")
    assert deltas["tp2+ep"][0] <= 1e-4
    assert_each_rank_holds_only_its_experts(ranks, fp8_experts_only)
    assert {info["dtype"] for layers in ranks for info in layers.values()} == {"float8_e4m3fn"}


def test_fp8_tp2_ep_matches_tp1(fp8_conditioned):
    deltas, ranks = run_pair(fp8_conditioned, "float32", control=True)
    assert_ep_adds_nothing_to_tp(deltas)
    assert_each_rank_holds_only_its_experts(ranks, fp8_conditioned)
    # The ranks hold FP8 expert weights (the portable path keeps them so), not an upcast copy.
    assert {info["dtype"] for layers in ranks for info in layers.values()} == {"float8_e4m3fn"}


def test_fingerprints_tell_experts_apart(tiny_fp32):
    """The inventory check above could not pass with a wrong expert in a slot: every expert's
    fingerprint differs from every other expert's in the same layer by far more than its tolerance."""
    fingerprints = checkpoint_expert_fingerprints(tiny_fp32)
    for layer in range(1, 1 + MOE_LAYERS):
        values = sorted(fingerprints[(layer, e)] for e in range(NUM_EXPERTS))
        assert min(b - a for a, b in zip(values, values[1:])) > 1e-2
    assert torch.tensor(list(fingerprints.values())).abs().min() > 1e-2  # no expert sums to ~0 either
