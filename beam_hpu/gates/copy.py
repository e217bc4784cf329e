"""Copy: a passage restarted at its end must continue exactly for K tokens (greedy, token ids)."""

from __future__ import annotations

from beam_hpu.gates.common import Filler
from beam_hpu.gates.result import GateResult


def run(ep, profile, **_) -> GateResult:
    filler = Filler(ep, profile.pieces(), profile.seed + 41)
    rows = []
    m, k = profile.copy_restart, profile.copy_tokens
    for length in profile.copy_lengths:
        passage = filler.ids(length - m)
        prompt = passage + passage[:m]
        out = ep.complete_ids(prompt, k, ignore_eos=True)["token_ids"]
        want = passage[m:m + k]
        same = 0
        while same < k and out[same] == want[same]:
            same += 1
        rows.append({"prompt_tokens": len(prompt), "matched": same, "of": k})
    passed = all(r["matched"] == r["of"] for r in rows)
    return GateResult("copy", passed, "; ".join(f"{r['matched']}/{r['of']} tokens at {r['prompt_tokens']:,} tokens"
                                                for r in rows), {"rows": rows})
