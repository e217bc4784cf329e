"""FP8 KV cache on every host: the rounding definition, attention through it within the bound the
rounding explains, the reference's FP8-KV mode (in memory and streamed), calibrated against default
scales on the tiny trained Beam's scored passages, and `beam-hpu calibrate-kv`'s overlay."""

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from beam_hpu.cli import main as cli
from beam_hpu.gates.profile import get_profile
from beam_hpu.quant.rounding import (DEFAULT_KV_SCALE, FP8_E4M3FN_MAX, GAUDI2_FP8_MAX, fp8_kv_round,
                                     kv_cache_scale, kv_device_step)
from beam_hpu.reference import kv_fp8
from beam_hpu.reference.in_memory import load_reference, next_token_logprobs
from beam_hpu.reference.kv_calibration import calibrate_kv
from beam_hpu.reference.kv_overlay import SHARD_NAME, read_kv_scales, tensor_name
from beam_hpu.reference.plan import Passage
from beam_hpu.reference.streamed import write_streamed_reference

VOCAB = 512
# e4m3: 3 mantissa bits, so a normal value is off by at most 2**-4 of itself; below the smallest
# normal (2**-6 steps) the grid is 2**-9 steps apart, so off by at most 2**-10 steps.
E4M3_HALF_ULP = 2.0**-4
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10


@pytest.fixture(scope="module")
def trained_fp8(tmp_path_factory):
    from beam_hpu.quant.fp8_checkpoint import quantize_checkpoint
    from beam_hpu.tiny.checkpoint import TRAINED_DIR

    return quantize_checkpoint(TRAINED_DIR, tmp_path_factory.mktemp("trained") / "fp8")


@pytest.fixture(scope="module")
def short_passages() -> list[Passage]:
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randint(8, VOCAB, (n,), generator=g).tolist() for n in (40, 70))
    return [Passage("a", a), Passage("b", b, [0] + [int(i % 2 == 0) for i in range(1, 70)])]


@pytest.fixture(scope="module")
def calibrated(trained_fp8, short_passages, tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "overlay"
    result = calibrate_kv(trained_fp8, short_passages, out, dtype=torch.float32, fp8_max=FP8_E4M3FN_MAX, exact=True)
    return out, result


def digest(directory: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


# ---------------------------------------------------------------- the definition


@pytest.mark.parametrize("fp8_max", [FP8_E4M3FN_MAX, GAUDI2_FP8_MAX])
@pytest.mark.parametrize("exact", [True, False])
def test_kv_rounding_is_e4m3_on_the_device_step_within_half_an_ulp(fp8_max, exact):
    scale = 0.0123
    step = kv_device_step(scale, fp8_max)
    assert step == pytest.approx(scale * 448 / fp8_max, rel=1e-12)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float() * 2.0
    x[:16] = torch.logspace(-6, 0, 16) * step  # the subnormal range
    r = fp8_kv_round(x, scale, fp8_max, exact)
    # on the grid: step times an e4m3 value
    grid = (r / step).to(torch.float8_e4m3fn).float()
    torch.testing.assert_close(r / step, grid, rtol=1e-6, atol=0)
    inside = x.abs() <= fp8_max * step
    bound = torch.maximum(x.abs() * E4M3_HALF_ULP, torch.tensor(step * E4M3_SUBNORMAL_HALF_STEP))
    assert bool(((r - x).abs()[inside] <= bound[inside] * (1 + 1e-6)).all())
    # beyond the range: saturated, never inf or NaN
    big = torch.tensor([1e6, -1e6])
    assert fp8_kv_round(big, scale, fp8_max, exact).tolist() == pytest.approx([fp8_max * step, -fp8_max * step])


def test_exact_and_fast_kv_rounding_differ_by_at_most_one_grid_step():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(1))
    a, b = (fp8_kv_round(x, 0.01, GAUDI2_FP8_MAX, e) for e in (True, False))
    diff = (a - b).abs()
    assert bool((diff <= x.abs() * 2 * E4M3_HALF_ULP + 1e-9).all())


def attention(q, k, v, scale):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                            enable_gqa=True)


@pytest.mark.parametrize("fp8_max", [FP8_E4M3FN_MAX, GAUDI2_FP8_MAX])
def test_attention_over_fp8_kv_is_within_the_bound_its_rounding_explains(fp8_max):
    """[B, H, T, D] fp32 attention with K and V through `fp8_kv_round` against the same attention
    in fp32. Per query row and channel: logits move by at most d = scale * sum_i |q_i| |e_k,i|,
    so each probability by a factor in [e^-2d, e^2d] and their L1 change is at most e^(2d) - 1; the
    output moves by at most max_j |e_v,j| + (e^(2d) - 1) max_j |v_j|, with e the rounding errors."""
    g = torch.Generator().manual_seed(2)
    B, Hq, Hkv, T, D = 1, 4, 2, 96, 32
    q, k, v = (torch.randn(B, h, T, D, generator=g) * s for h, s in ((Hq, 1.0), (Hkv, 1.5), (Hkv, 0.7)))
    k_scale, v_scale = kv_cache_scale(float(k.abs().max())), kv_cache_scale(float(v.abs().max()))
    kr, vr = fp8_kv_round(k, k_scale, fp8_max), fp8_kv_round(v, v_scale, fp8_max)
    sm = D**-0.5
    err = (attention(q, kr, vr, sm) - attention(q, k, v, sm)).abs()  # [B, Hq, T, D]
    ek, ev = (kr - k).abs(), (vr - v).abs()
    group = Hq // Hkv
    ek, ev, vv = (t.repeat_interleave(group, dim=1) for t in (ek, ev, v))
    causal = torch.ones(T, T).tril().bool()
    d = sm * torch.einsum("bhid,bhjd->bhij", q.abs(), ek)  # [B, Hq, T(query), T(key)]
    d = d.masked_fill(~causal, 0).amax(-1)  # over the keys a row attends
    ev_max = torch.stack([ev[:, :, : i + 1].amax(2) for i in range(T)], dim=2)  # [B, Hq, T, D]
    v_max = torch.stack([vv[:, :, : i + 1].abs().amax(2) for i in range(T)], dim=2)
    bound = ev_max + (torch.exp(2 * d)[..., None] - 1) * v_max
    assert bool((err <= bound * (1 + 1e-5) + 1e-7).all())
    assert float((err / bound).max()) > 0.01  # the bound is not vacuous: errors of its order occur
    # A cache that ignored the scale (rounding x itself) would be far outside it on these magnitudes.
    wrong = attention(q, kr, fp8_kv_round(v * 1e-3, v_scale, fp8_max) * 1e3, sm)
    assert not bool(((wrong - attention(q, k, v, sm)).abs() <= bound * (1 + 1e-5) + 1e-7).all())


# ---------------------------------------------------------------- the reference's FP8-KV mode


def test_the_reference_hands_attention_exactly_the_rounded_k_and_v(trained_fp8, calibrated):
    """What transformers' attention function receives under --kv-scales is fp8_kv_round of the K and V
    the model computed (after k_norm and RoPE), per layer with that layer's scales; nothing else moves."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    scales = read_kv_scales(calibrated[0])
    model = load_reference(trained_fp8, fp8_max=GAUDI2_FP8_MAX, kv_scales=scales)
    seen, received = {}, {}
    kv_fp8.set_kv_observer(model, lambda i, q, k, v: seen.__setitem__(i, (q.clone(), k.clone(), v.clone())))
    base = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def recording(module, q, k, v, mask, **kw):
        received[module.layer_idx] = (q.clone(), k.clone(), v.clone())
        return base(module, q, k, v, mask, **kw)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = recording  # this instance's local mapping: the wrapper's lookup
    try:
        ids = list(range(8, 80))
        with_kv = next_token_logprobs(model, ids)
        kv_fp8.set_kv_rounding(model, None, GAUDI2_FP8_MAX)
        without = next_token_logprobs(model, ids)
        unrounded = dict(received)
    finally:
        del ALL_ATTENTION_FUNCTIONS._local_mapping["sdpa"]
        kv_fp8.set_kv_observer(model, None)
    assert sorted(seen) == list(range(5))
    for i, (q, k, v) in unrounded.items():  # rounding off: the computed tensors themselves
        assert torch.equal(q, seen[i][0]) and torch.equal(k, seen[i][1]) and torch.equal(v, seen[i][2])
    assert (with_kv - without).abs().max() > 1e-4  # the rounding acts on the outputs


def test_rounded_tensors_are_the_definition(trained_fp8, calibrated):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    scales = read_kv_scales(calibrated[0])
    model = load_reference(trained_fp8, fp8_max=GAUDI2_FP8_MAX, exact=False, kv_scales=scales)
    seen, received = {}, {}
    kv_fp8.set_kv_observer(model, lambda i, q, k, v: seen.__setitem__(i, (k.clone(), v.clone())))
    base = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = lambda m, q, k, v, mask, **kw: (
        received.__setitem__(m.layer_idx, (k.clone(), v.clone())) or base(m, q, k, v, mask, **kw))
    try:
        next_token_logprobs(model, list(range(8, 60)))
    finally:
        del ALL_ATTENTION_FUNCTIONS._local_mapping["sdpa"]
    for i, (k, v) in seen.items():
        ks, vs = scales.layers[i]
        assert torch.equal(received[i][0], fp8_kv_round(k, ks, GAUDI2_FP8_MAX, exact=False).to(k.dtype))
        assert torch.equal(received[i][1], fp8_kv_round(v, vs, GAUDI2_FP8_MAX, exact=False).to(v.dtype))


def test_streamed_kv_reference_is_the_in_memory_one_and_records_its_cost(trained_fp8, calibrated, short_passages,
                                                                         tmp_path):
    scales = read_kv_scales(calibrated[0])
    doc = write_streamed_reference(trained_fp8, short_passages, tmp_path / "ref.json", dtype=torch.float32,
                                   fp8_max=GAUDI2_FP8_MAX, exact=True, profile=get_profile("cpu"), k=5,
                                   kv_scales=scales)
    assert doc["kv_fp8"] == {"scales": scales.source, "fp8_max": GAUDI2_FP8_MAX}
    assert "FP8 KV cache" in doc["reference"]
    model = load_reference(trained_fp8, fp8_max=GAUDI2_FP8_MAX, dtype=torch.float32, exact=True)
    for p, got in zip(short_passages, doc["passages"]):
        kv_fp8.set_kv_rounding(model, scales, GAUDI2_FP8_MAX, exact=True)
        lp_with = next_token_logprobs(model, p.ids)
        kv_fp8.set_kv_rounding(model, None, GAUDI2_FP8_MAX)
        lp_without = next_token_logprobs(model, p.ids)
        ids = torch.tensor(p.ids[1:])
        expected = lp_with[:-1].gather(1, ids[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got["token_logprobs"][1:]), expected, rtol=0, atol=1e-5)
        at = [i - 1 for i in range(1, len(p.ids)) if p.scored is None or p.scored[i]]
        kl = (lp_without[at].exp() * (lp_without[at] - lp_with[at])).sum(-1).mean()
        nll = lambda lp: -lp[:-1].gather(1, ids[:, None])[at, 0].double().mean()  # noqa: E731
        cost = got["kv_fp8_cost"]
        assert cost["kl"] == pytest.approx(float(kl), rel=1e-3, abs=1e-8)
        assert cost["ppl_rel"] == pytest.approx(float(torch.exp(nll(lp_with) - nll(lp_without)) - 1), abs=1e-6)
        agree = (lp_with[at].argmax(-1) == lp_without[at].argmax(-1)).double().mean()
        assert cost["top1"] == pytest.approx(float(agree))
        assert cost["kl"] > 0


def test_calibrated_scales_beat_the_default_ones_on_the_trained_beams_scored_passages(trained_fp8):
    """The tiny trained Beam's gate passages (scored positions), per-token FP8 reference in fp32 at
    Gaudi 2's range and at 448: the K and V its layers compute, rounded with the scales calibrated
    on those passages and with the default 1.0. e4m3 is a float: a scale moves only what saturates
    (nothing here: |K|, |V| < 8, under the default's 448 / 240 * 1.87) and what falls below the
    smallest normal (2**-6 steps). There the default loses: in every layer it flushes K and V
    elements to zero that the calibrated scale keeps, and its mean relative error is larger. The
    absolute (RMS) error is the same to a few percent either way, and at the model's outputs the two
    are not told apart on this model: KL 1.3e-3 vs 1.7e-3 at 448, 1.1e-3 vs 0.9e-3 at 240
    (benchmarks/kv_fp8_cost.py), both within the spread FP8 roundings give this tiny Beam."""
    from transformers import AutoTokenizer

    from beam_hpu.gates import perplexity

    tok = AutoTokenizer.from_pretrained(str(trained_fp8))

    class Tokenizer:
        def tokenize(self, text):
            return tok(text, add_special_tokens=False).input_ids

    passages = perplexity.cpu_passages(Tokenizer(), get_profile("cpu"), trained_fp8)
    model = load_reference(trained_fp8, dtype=torch.float32)
    ranges, seen = {}, {}
    observe = kv_fp8.amax_observer(ranges)

    def keep(i, q, k, v):
        observe(i, q, k, v)
        seen.setdefault(i, []).append((k.clone(), v.clone()))

    kv_fp8.set_kv_observer(model, keep)
    for ids, _ in passages.values():
        next_token_logprobs(model, ids)
    kv_fp8.set_kv_observer(model, None)
    for fp8_max in (GAUDI2_FP8_MAX, FP8_E4M3FN_MAX):
        for i, pairs in seen.items():
            for kind, j in (("k", 0), ("v", 1)):
                x = torch.cat([p[j].flatten() for p in pairs])
                cal = kv_cache_scale(float(ranges[kv_fp8.range_key(kind, i)]))
                stats = {}
                for name, s in (("calibrated", cal), ("default", DEFAULT_KV_SCALE)):
                    r = fp8_kv_round(x, s, fp8_max)
                    nonzero = x != 0
                    stats[name] = (float(((r - x).abs() / x.abs())[nonzero].mean()),
                                   int(((r == 0) & nonzero).sum()))
                (rel_cal, flushed_cal), (rel_def, flushed_def) = stats["calibrated"], stats["default"]
                assert rel_cal < rel_def and flushed_def > 2 * flushed_cal, (fp8_max, i, kind, stats)
                assert flushed_def > 1e-4 * x.numel()  # measurably: more than 1 in 10,000 elements


# ---------------------------------------------------------------- calibrate-kv and its overlay


def test_calibration_writes_the_observed_ranges_as_an_overlay(trained_fp8, calibrated, short_passages):
    out, result = calibrated
    # The scales are amax / 448 of what the in-memory reference's layers compute on the passages.
    model = load_reference(trained_fp8, fp8_max=FP8_E4M3FN_MAX, dtype=torch.float32, exact=True)
    ranges = {}
    kv_fp8.set_kv_observer(model, kv_fp8.amax_observer(ranges))
    for p in short_passages:
        next_token_logprobs(model, p.ids)
    for i in range(5):
        for kind in "kvq":
            amax = float(ranges[kv_fp8.range_key(kind, i)])
            assert result["amax"][i][kind] == pytest.approx(amax, rel=1e-5)
            assert result["scales"][i][kind] == pytest.approx(amax / 448, rel=1e-5)
    # The overlay: the source untouched, its files linked, the added shard, index and config.
    assert {p.name for p in out.iterdir()} == {p.name for p in trained_fp8.iterdir()} | {SHARD_NAME}
    for p in out.iterdir():
        assert p.is_symlink() == (p.name not in ("config.json", "model.safetensors.index.json", SHARD_NAME))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["kv_cache_scheme"] == {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    assert json.loads((trained_fp8 / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] is None
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index[tensor_name(3, "v")] == SHARD_NAME
    scales = read_kv_scales(out)
    assert scales.layers == {i: (pytest.approx(result["scales"][i]["k"]), pytest.approx(result["scales"][i]["v"]))
                             for i in range(5)}
    # compressed-tensors' own config model accepts the scheme (what the reference and vLLM parse).
    from compressed_tensors.quantization import QuantizationConfig

    assert QuantizationConfig.model_validate(config["quantization_config"]).kv_cache_scheme.num_bits == 8


def test_calibration_resumes_and_writes_in_place_without_touching_the_shards(trained_fp8, short_passages, tmp_path,
                                                                              calibrated, caplog):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained_fp8, ckpt)
    before = digest(ckpt)
    work = tmp_path / "work"
    kw = dict(dtype=torch.float32, fp8_max=FP8_E4M3FN_MAX, exact=True, workdir=work)
    assert calibrate_kv(ckpt, short_passages, ckpt, stop_after_layer=1, **kw) is None
    assert not (ckpt / SHARD_NAME).exists()
    layers = []
    with caplog.at_level("INFO", logger="vllm.beam_hpu.reference"):
        result = calibrate_kv(ckpt, short_passages, ckpt, on_layer=lambda i, *_: layers.append(i), **kw)
    assert layers == [2, 3, 4]  # resumed after layer 1
    assert any("resuming" in r.message for r in caplog.records)
    assert any("ETA" in r.message and "calibrate-kv" in r.message for r in caplog.records)
    assert result["scales"] == calibrated[1]["scales"]  # as the uninterrupted run
    after = digest(ckpt)
    for name in before:
        if name not in ("config.json", "model.safetensors.index.json"):
            assert after[name] == before[name], name
    assert after["config.json.before-kv-scales"] == before["config.json"]
    assert read_kv_scales(ckpt).layers.keys() == set(range(5))


def test_bad_input_is_refused_before_anything_is_read_or_written(trained_fp8, short_passages, tmp_path, calibrated):
    from beam_hpu.tiny.checkpoint import TRAINED_DIR

    cases = [
        (TRAINED_DIR, short_passages, tmp_path / "o1", "no compressed-tensors quantization_config"),
        (calibrated[0], short_passages, tmp_path / "o2", "already has a kv_cache_scheme"),
        (trained_fp8, [Passage("x", [1, VOCAB])], tmp_path / "o3", "outside the vocabulary"),
        (trained_fp8, short_passages, trained_fp8 / "sub", "inside the checkpoint"),
    ]
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    cases.append((trained_fp8, short_passages, full, "not empty"))
    for ckpt, passages, out, message in cases:
        with pytest.raises(ValueError, match=message):
            calibrate_kv(ckpt, passages, out, workdir=tmp_path / "w")
        assert not (tmp_path / "w").exists() and not (out / SHARD_NAME).exists()


def test_cli_calibrates_and_the_reference_prints_the_cost(trained_fp8, tmp_path, capsys):
    g = torch.Generator().manual_seed(5)
    passages = tmp_path / "p.json"
    passages.write_text(json.dumps({"p": torch.randint(8, VOCAB, (48,), generator=g).tolist()}))
    out = tmp_path / "overlay"
    assert cli(["calibrate-kv", str(trained_fp8), "--passages", str(passages), "--out", str(out),
                "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    assert "| 4 |" in printed and f"wrote {out.resolve()}" in printed
    assert cli(["reference", str(trained_fp8), "--passages", str(passages), "--out", str(tmp_path / "r.json"),
                "--fp8-max", "240", "--dtype", "float32", "--kv-scales", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "FP8 KV cache" in printed and "| p |" in printed
    ref = json.loads((tmp_path / "r.json").read_text())
    assert math.isfinite(ref["passages"][0]["kv_fp8_cost"]["kl"])
    with pytest.raises(ValueError, match="no kv_cache_scheme"):
        cli(["reference", str(trained_fp8), "--passages", str(passages), "--out", str(tmp_path / "r2.json"),
             "--kv-scales", str(trained_fp8)])


def test_the_live_gates_reference_models_the_cache_with_kv_scales(trained_fp8, calibrated):
    """`beam-gates --reference-checkpoint DIR --kv-scales OVERLAY`: the live reference is the FP8 KV
    reference at vLLM-CPU's range (448), and a stored reference with --kv-scales on top is refused."""
    from beam_hpu.gates import perplexity
    from beam_hpu.reference.live import live_reference

    scales = read_kv_scales(calibrated[0])
    ids = list(range(8, 70))
    profile = get_profile("cpu")
    doc = live_reference(trained_fp8, {"p": ids}, 5, profile, exact=True, kv_scales=scales)
    assert "FP8 KV cache" in doc["reference"]
    model = load_reference(trained_fp8, dtype=getattr(torch, profile.reference_dtype), exact=True, kv_scales=scales)
    expected = next_token_logprobs(model, ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(doc["passages"][0]["token_logprobs"][1:]), expected, rtol=0, atol=1e-6)
    refused = perplexity.run(None, profile, reference_file="ref.json", kv_scales=str(calibrated[0]))
    assert not refused.passed and "--kv-scales is for a live reference" in refused.result
