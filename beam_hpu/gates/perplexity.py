"""Perplexity, top-1 agreement and KL of the server's `prompt_logprobs` against the reference.

Reference, per passage (token ids fixed in advance), in the format of
`beam_hpu.reference.file_format` (`beam-gates-reference/1`):
  - live (CPU, `--reference-checkpoint DIR`): `beam_hpu.reference.live.live_reference`, the per-token
    FP8 reference for an FP8 checkpoint, transformers' Beam for an unquantised one, computed at the
    profile's `reference_dtype` (the server's precision: bf16 on the node, float32 in the CPU profile);
  - stored (the 501B model, `--reference-file FILE`): written by `beam-hpu reference`
    (`beam_hpu.reference.streamed`) on a CPU host that streams the checkpoint layer by layer.

Gates, per passage: |perplexity change| <= ppl_rel; top-1 >= floor - top1_margin; mean KL <= kl.
KL is computed from top-k lists (the server returns at most `--max-logprobs`, 20 by default):
both distributions coarse-grained to the tokens in both top-k lists plus one "rest" bucket. Coarse
graining never increases KL, so this is a lower bound on the full KL.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from beam_hpu.gates.common import Filler
from beam_hpu.gates.result import GateResult
from beam_hpu.reference.file_format import FORMAT, scored_positions
from beam_hpu.reference.live import live_reference


def coarse_kl(ref_top: dict[int, float], test_top: dict[int, float]) -> float:
    shared = [t for t in ref_top if t in test_top]
    p = [math.exp(ref_top[t]) for t in shared]
    q = [math.exp(test_top[t]) for t in shared]
    kl = sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q) if pi > 0)
    pr, qr = max(1.0 - sum(p), 0.0), max(1.0 - sum(q), 1e-12)
    return kl + (pr * (math.log(pr) - math.log(qr)) if pr > 1e-12 else 0.0)


def score_passage(ep, ref: dict, k: int) -> dict:
    ids = ref["token_ids"]
    served = ep.prompt_top(ids, k)
    positions = scored_positions(ref)
    ref_lp, srv_lp, agree, kls = [], [], 0, []
    for i in positions:
        lps, top = served[i]
        srv_lp.append(lps[ids[i]])
        ref_lp.append(ref["token_logprobs"][i])
        agree += top == ref["top1"][i]
        kls.append(coarse_kl({int(a): b for a, b in ref["topk"][i]}, lps))
    n = len(positions)
    ppl_ref, ppl_srv = math.exp(-sum(ref_lp) / n), math.exp(-sum(srv_lp) / n)
    return {"name": ref["name"], "tokens": len(ids), "scored": n, "ppl_ref": ppl_ref, "ppl_served": ppl_srv,
            "ppl_change": ppl_srv / ppl_ref - 1.0, "top1": agree / n, "floor_top1": ref["floor_top1"],
            "kl": sum(kls) / n}


def cpu_passages(ep, profile, tokenizer_dir) -> dict[str, tuple[list[int], list[bool]]]:
    """The tiny trained Beam's passages, each with the positions it was trained to predict:
    - copy passages (profile.ppl_passage_tokens long): filler, then the same filler again, scored
      on the repeat after its first token;
    - conversations in Beam's chat format (profile.ppl_conversations: kinds of
      `beam_hpu.tiny.tasks.Tasks`, seeded), scored on the assistant turns."""
    from transformers import AutoTokenizer

    from beam_hpu.tiny.tasks import Tasks

    filler = Filler(ep, profile.pieces(), profile.seed + 11)
    out = {}
    for n in profile.ppl_passage_tokens:
        half = filler.ids(n // 2)
        ids = (half + half)[:n]
        out[f"copy-{n}"] = (ids, [False] * (len(half) + 1) + [True] * (len(ids) - len(half) - 1))
    longest = max(profile.ppl_passage_tokens)
    tasks = Tasks(AutoTokenizer.from_pretrained(str(tokenizer_dir)), max_len=longest)
    rng = random.Random(profile.seed + 13)
    for j, kind in enumerate(profile.ppl_conversations):
        ids, trained = (x[:longest] for x in getattr(tasks, kind)(rng))
        # trained[i]: token i is predicted by the model (it was a training target)
        out[f"{kind}-{j}"] = (ids, [False] + list(trained[1:]))
    return out


def run(ep, profile, reference_checkpoint=None, reference_file=None, kv_scales=None, **_) -> GateResult:
    if reference_file and kv_scales:
        return GateResult("perplexity", False, "--kv-scales is for a live reference; a stored one models FP8 KV "
                          "when `beam-hpu reference --kv-scales` wrote it")
    if reference_file:
        ref = json.loads(Path(reference_file).read_text())
        if ref.get("format") != FORMAT:
            raise ValueError(f"{reference_file}: format {ref.get('format')!r}, expected {FORMAT!r}")
    elif reference_checkpoint:
        from beam_hpu.reference.kv_overlay import read_kv_scales

        ref = live_reference(reference_checkpoint, cpu_passages(ep, profile, reference_checkpoint),
                             profile.ppl_topk, profile, kv_scales=read_kv_scales(kv_scales) if kv_scales else None)
    else:
        return GateResult("perplexity", False, "no reference: pass --reference-checkpoint DIR (live, CPU) or "
                          "--reference-file FILE (stored)")
    g = ref["gates"]
    rows = [score_passage(ep, p, ref["topk"]) for p in ref["passages"]]
    ok = [abs(r["ppl_change"]) <= g["ppl_rel"] and r["top1"] >= r["floor_top1"] - g["top1_margin"]
          and r["kl"] <= g["kl"] for r in rows]
    def col(fmt: str, key: str, scale: float = 1.0) -> str:
        return " / ".join(format(r[key] * scale if scale != 1.0 else r[key], fmt) for r in rows)

    result = (f"vs {ref['reference']}, {len(rows)} passages ({col('d', 'scored')} of {col('d', 'tokens')} "
              f"tokens scored): "
              f"perplexity {col('+.2f', 'ppl_change', 100)}% (gate ±{100 * g['ppl_rel']:.0f}%); "
              f"top-1 {col('.2f', 'top1', 100)}% (floor {col('.2f', 'floor_top1', 100)}%, "
              f"gate floor - {100 * g['top1_margin']:.0f} points); KL {col('.4f', 'kl')} (gate {g['kl']})")
    return GateResult("perplexity", all(ok), result, {"passages": rows, "gates": g})
