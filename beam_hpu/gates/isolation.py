"""Isolation: N different requests at once, each asking for its own code; each answer holds its own
code and no other request's. At temperature 0 the batched answers are compared with solo runs
(required when the profile says so: exact on CPU; the recipe documents FP8 near-tie flips on Gaudi)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

from beam_hpu.tiny import tasks as syn
from beam_hpu.gates.client import assembled
from beam_hpu.gates.common import Filler, user
from beam_hpu.gates.result import GateResult


def run(ep, profile, **_) -> GateResult:
    rng = random.Random(profile.seed + 51)
    filler = Filler(ep, profile.pieces(), profile.seed + 52)
    n = profile.isolation_requests
    keys, codes = [syn.random_key(rng) for _ in range(n)], [syn.random_code(rng) for _ in range(n)]
    while len(set(codes)) < n:
        codes = [syn.random_code(rng) for _ in range(n)]
    prompts = [syn.needle_prompt(filler.text(profile.isolation_haystack_tokens), k, c, rng.random())
               for k, c in zip(keys, codes)]

    def one(p):
        return assembled(ep.chat(user(p), temperature=0.0, max_tokens=profile.max_tokens_chat))

    with ThreadPoolExecutor(n) as pool:
        batched = list(pool.map(one, prompts))
    solo = [one(p) for p in prompts]
    own = sum(codes[i] in r["content"] for i, r in enumerate(batched))
    foreign = sum(1 for i, r in enumerate(batched) for j, c in enumerate(codes)
                  if j != i and (c in r["content"] or c in r["reasoning"]))
    equal = sum(b["content"] == s["content"] and b["reasoning"] == s["reasoning"] for b, s in zip(batched, solo))
    passed = own == n and foreign == 0 and (equal == n or not profile.isolation_batch_equal)
    return GateResult("isolation", passed,
                      f"{n} different requests at once: own code {own}/{n}, foreign content {foreign}; "
                      f"batched == solo {equal}/{n}" + ("" if profile.isolation_batch_equal else " (not gated)"),
                      {"codes": codes, "batched": [b["content"] for b in batched], "solo": [s["content"] for s in solo]})
