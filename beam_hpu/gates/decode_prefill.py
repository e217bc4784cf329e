"""Decode vs prefill: greedy tokens past the window, then the same sequence scored in one prefill
(`prompt_logprobs`); the mean |logprob delta| of the generated tokens must stay under a bound."""

from __future__ import annotations

from beam_hpu.gates.common import Filler
from beam_hpu.gates.result import GateResult


def run(ep, profile, **_) -> GateResult:
    filler = Filler(ep, profile.pieces(), profile.seed + 21)
    deltas, rows = [], []
    for k in range(profile.dvp_prompts):
        prompt = filler.ids(profile.dvp_prompt_tokens)
        gen = ep.complete_ids(prompt, profile.dvp_decode_tokens, ignore_eos=True)
        full = prompt + gen["token_ids"]
        scored = ep.prompt_logprobs(full, 0)
        d = [abs(lp - scored[len(prompt) + i][t]) for i, (t, lp) in enumerate(zip(gen["token_ids"], gen["logprobs"]))]
        deltas += d
        rows.append({"prompt_tokens": len(prompt), "decoded": len(d), "mean": sum(d) / len(d), "max": max(d)})
    mean = sum(deltas) / len(deltas)
    passed = mean <= profile.dvp_gate and all(r["decoded"] == profile.dvp_decode_tokens for r in rows)
    return GateResult("decode_prefill", passed,
                      f"{profile.dvp_prompts} x {profile.dvp_decode_tokens} greedy tokens past the window: "
                      f"mean |Δlogprob| {mean:.3f} (gate {profile.dvp_gate}), max {max(deltas):.3f}", {"rows": rows})
