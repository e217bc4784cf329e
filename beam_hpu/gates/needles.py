"""Needles: `The code for KEY is CODE.` planted at depths x lengths, asked for at the end; the code
must be in the answer. A control asks for a key that was never planted: no planted code may appear."""

from __future__ import annotations

import random

from beam_hpu.tiny import tasks as syn
from beam_hpu.gates.client import assembled
from beam_hpu.gates.common import Filler, user
from beam_hpu.gates.result import GateResult


def ask(ep, profile, prompt: str) -> dict:
    return assembled(ep.chat(user(prompt), temperature=0.0, max_tokens=profile.max_tokens_chat))


def run(ep, profile, **_) -> GateResult:
    rng = random.Random(profile.seed + 31)
    filler = Filler(ep, profile.pieces(), profile.seed + 32)
    rows, codes = [], []
    for length in profile.needle_lengths:
        hay = filler.text(length - 40)  # room for the needle, the question and the chat markup
        for depth in profile.needle_depths:
            key, code = syn.random_key(rng), syn.random_code(rng)
            codes.append(code)
            r = ask(ep, profile, syn.needle_prompt(hay, key, code, depth))
            rows.append({"length": length, "depth": depth, "key": key, "code": code, "answer": r["content"],
                         "found": code in r["content"], "finish": r["finish_reason"]})
    control_key = syn.random_key(rng)
    ctrl = ask(ep, profile, syn.needle_prompt(filler.text(profile.needle_lengths[0] - 40), control_key, None, 0.5))
    leaked = [c for c in codes if c in ctrl["content"] or c in ctrl["reasoning"]]
    found = sum(r["found"] for r in rows)
    passed = found == len(rows) and not leaked
    lengths = ", ".join(str(x) for x in profile.needle_lengths)
    return GateResult("needles", passed,
                      f"{len(rows)//len(profile.needle_depths)} lengths ({lengths} tokens) x depths "
                      f"{' / '.join(str(d) for d in profile.needle_depths)}: {found}/{len(rows)} in the answer; "
                      f"control without the needle {'clean' if not leaked else 'LEAKED ' + ','.join(leaked)}",
                      {"rows": rows, "control": {"key": control_key, "answer": ctrl["content"], "leaked": leaked}})
