"""Smoke: N chat prompts at temperature 0 -> expected answer, finish `stop`, reasoning present, no
template markup in content."""

from __future__ import annotations

from beam_hpu.gates.client import assembled
from beam_hpu.gates.common import has_markup, user
from beam_hpu.gates.result import GateResult


def run(ep, profile, **_) -> GateResult:
    rows = []
    for prompt, expected in profile.smoke_prompts:
        r = assembled(ep.chat(user(prompt), temperature=0.0, max_tokens=profile.max_tokens_chat))
        rows.append({"prompt": prompt, "expected": expected, "content": r["content"],
                     "reasoning": r["reasoning"][:200], "finish": r["finish_reason"],
                     "correct": expected.lower() in r["content"].lower(), "stop": r["finish_reason"] == "stop",
                     "has_reasoning": bool(r["reasoning"].strip()), "clean": not has_markup(r["content"])})
    n = len(rows)
    c = {k: sum(row[k] for row in rows) for k in ("correct", "stop", "has_reasoning", "clean")}
    passed = n > 0 and all(v == n for v in c.values())
    return GateResult("smoke", passed,
                      f"{n} chat prompts, temperature 0: {c['correct']}/{n} correct, finish `stop` {c['stop']}/{n}, "
                      f"reasoning {c['has_reasoning']}/{n}, no template markup {c['clean']}/{n}", {"rows": rows})
