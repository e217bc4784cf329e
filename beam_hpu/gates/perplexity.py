"""Perplexity, top-1 agreement and KL of the server's `prompt_logprobs` against the reference.

Reference, per passage (token ids fixed in advance):
  - live (CPU, `--reference-checkpoint DIR`): the per-token FP8 reference of `beam_hpu.quant.reference`
    for an FP8 checkpoint, transformers' Beam for an unquantised one, computed at the profile's
    `reference_dtype` (the server's precision: bf16 on the node, float32 in the CPU profile). The
    top-1 floor is what a second model reaches against that reference: for FP8, transformers' Beam with the weights dequantised
    (no activation rounding); unquantised, transformers' Beam at the other precision.
  - stored (the 501B model, `--reference-file FILE`): a JSON file in the format below, written by
    `write_reference_file` on a CPU host that can hold the model.

Reference file format (`beam-gates-reference/1`), JSON:
  {"format": "beam-gates-reference/1", "model": str, "reference": str (how it was computed),
   "topk": int, "gates": {"ppl_rel": float, "kl": float, "top1_margin": float},
   "passages": [{"name": str, "token_ids": [int], "token_logprobs": [null, float...],
                 "top1": [null, int...], "topk": [null, [[int, float], ...]...], "floor_top1": float}]}
  Position i holds log p(token i | tokens < i) and the reference's top-k at i (null at 0).
  Optional per passage: "scored": [0|1, ...] (one per token, 0 at position 0): the positions the
  gates count; absent = every position from 1. The stored references for the 501B model score
  every position of natural text. The tiny trained Beam (CPU profile) is scored where it was
  trained to predict: the repeat of a copy passage, the assistant turns of a conversation. Its
  other positions (random filler, prompts) were never trained, its outputs there are arbitrary, and
  FP8 activation rounding makes them chaotic: there the reference moves by several times the bars
  between bf16 and fp32, on the scored positions by a fraction of them
  (benchmarks/fp8_perplexity_noise_floor.py prints both; README, "Gate calibration").

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

FORMAT = "beam-gates-reference/1"


def coarse_kl(ref_top: dict[int, float], test_top: dict[int, float]) -> float:
    shared = [t for t in ref_top if t in test_top]
    p = [math.exp(ref_top[t]) for t in shared]
    q = [math.exp(test_top[t]) for t in shared]
    kl = sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q) if pi > 0)
    pr, qr = max(1.0 - sum(p), 0.0), max(1.0 - sum(q), 1e-12)
    return kl + (pr * (math.log(pr) - math.log(qr)) if pr > 1e-12 else 0.0)


def scored_positions(ref: dict) -> list[int]:
    scored = ref.get("scored")
    return [i for i in range(1, len(ref["token_ids"])) if scored is None or scored[i]]


def check_scored(name: str, ids: list[int], scored) -> None:
    if len(scored) != len(ids) or scored[0] or not any(scored):
        raise ValueError(f"passage {name}: 'scored' needs one flag per token, none at position 0 and "
                         f"at least one set")


def reference_passage(model, ids: list[int], k: int, name: str, floor_model=None,
                      scored: list[bool] | None = None) -> dict:
    from beam_hpu.quant.reference import next_token_logprobs

    lp = next_token_logprobs(model, ids)  # [len, vocab]: next token after position i
    rows_tok, rows_top1, rows_topk = [None], [None], [None]
    for i in range(1, len(ids)):
        row = lp[i - 1]
        v, t = row.topk(k)
        rows_tok.append(float(row[ids[i]]))
        rows_top1.append(int(t[0]))
        rows_topk.append([[int(a), float(b)] for a, b in zip(t, v)])
    out = {"name": name, "token_ids": ids, "token_logprobs": rows_tok, "top1": rows_top1, "topk": rows_topk}
    if scored is not None:
        check_scored(name, ids, scored)
        out["scored"] = [int(bool(x)) for x in scored]
    floor = 1.0
    if floor_model is not None:
        at = [i - 1 for i in scored_positions(out)]
        other = next_token_logprobs(floor_model, ids)[at].argmax(-1)
        floor = float((other == lp[at].argmax(-1)).double().mean())
    out["floor_top1"] = floor
    return out


def _ids_and_scored(passage) -> tuple[list[int], list[bool] | None]:
    return (passage[0], passage[1]) if isinstance(passage, tuple) else (passage, None)


def live_reference(checkpoint: str | Path, passages: dict, k: int, profile, exact: bool | None = None) -> dict:
    """`passages`: name -> token ids, or name -> (token ids, scored flags). `exact`: the FP8
    reference's activation rounding (beam_hpu.quant.rounding); None = BEAM_EXACT_ROUNDING as set
    here, which should be the server's, so that served and reference round alike."""
    import torch

    from beam_hpu.quant.reference import load_oracle, load_reference, quantization_config
    from beam_hpu.settings import switches

    checkpoint = Path(checkpoint)
    fp8 = quantization_config(checkpoint) is not None
    dtype = getattr(torch, profile.reference_dtype)
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    exact = switches.current("BEAM_EXACT_ROUNDING") if exact is None else exact
    model = load_reference(checkpoint, dtype=dtype, exact=exact) if fp8 else load_oracle(checkpoint, dtype)
    floor_model = load_oracle(checkpoint, dtype if fp8 else other)
    name = (f"per-token FP8 reference (beam_hpu.quant.reference, BEAM_EXACT_ROUNDING={int(exact)})" if fp8
            else "transformers Beam")
    return {"format": FORMAT, "model": str(checkpoint), "reference": f"{name}, {profile.reference_dtype}",
            "topk": k, "gates": {"ppl_rel": profile.ppl_rel_gate, "kl": profile.kl_gate,
                                 "top1_margin": profile.top1_margin},
            "passages": [reference_passage(model, ids, k, name, floor_model, scored)
                         for name, (ids, scored) in ((n, _ids_and_scored(p)) for n, p in passages.items())]}


def write_reference_file(checkpoint, passages: dict, path, profile, k: int = 20) -> None:
    Path(path).write_text(json.dumps(live_reference(checkpoint, passages, k, profile)) + "\n")


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


def run(ep, profile, reference_checkpoint=None, reference_file=None, **_) -> GateResult:
    if reference_file:
        ref = json.loads(Path(reference_file).read_text())
        if ref.get("format") != FORMAT:
            raise ValueError(f"{reference_file}: format {ref.get('format')!r}, expected {FORMAT!r}")
    elif reference_checkpoint:
        ref = live_reference(reference_checkpoint, cpu_passages(ep, profile, reference_checkpoint),
                             profile.ppl_topk, profile)
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


def main(argv=None) -> int:
    """Write a stored reference: python -m beam_hpu.gates.perplexity CHECKPOINT OUT.json --text F [--text F ...]
    (one passage per text file, tokenized with the checkpoint's tokenizer; gates from the gaudi profile)."""
    import argparse

    from transformers import AutoTokenizer

    from beam_hpu.gates.profile import get_profile

    ap = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--text", action="append", required=True)
    ap.add_argument("--topk", type=int, default=20)
    args = ap.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(args.checkpoint)
    passages = {Path(f).stem: tok(Path(f).read_text(), add_special_tokens=False).input_ids for f in args.text}
    write_reference_file(args.checkpoint, passages, args.out, get_profile("gaudi"), args.topk)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
