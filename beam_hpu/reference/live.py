"""The reference computed in memory: every passage through the whole model at once (CPU, tiny
checkpoints and any model the host can hold), as a `beam-gates-reference/1` document.

The live perplexity gate (`--reference-checkpoint`) computes it next to the server it judges; the
streamed reference (`streamed.py`) writes the same document for a model no host can hold, and its
tests compare the two. `profile` is a gate profile (`beam_hpu.gates.profile.Profile`): its
`reference_dtype` and its bars, which the document carries.
"""

from __future__ import annotations

import json
from pathlib import Path

from beam_hpu.reference.file_format import FORMAT, check_scored, gates_of, scored_positions


def reference_passage(model, ids: list[int], k: int, name: str, floor_model=None,
                      scored: list[bool] | None = None) -> dict:
    from beam_hpu.reference.in_memory import next_token_logprobs

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


def live_reference(checkpoint: str | Path, passages: dict, k: int, profile, exact: bool | None = None,
                   kv_scales=None, fp8_max: float | None = None) -> dict:
    """`passages`: name -> token ids, or name -> (token ids, scored flags). `exact`: the FP8
    reference's activation rounding (beam_hpu.quant.rounding); None = BEAM_EXACT_ROUNDING as set
    here, which should be the server's, so that served and reference round alike. `kv_scales`
    (kv_fp8.KvScales): the reference of a server with an FP8 KV cache of range `fp8_max`
    (default 448, vLLM-CPU's) using those scales."""
    import torch

    from beam_hpu.reference.in_memory import load_oracle, load_reference, quantization_config
    from beam_hpu.settings import switches

    checkpoint = Path(checkpoint)
    fp8 = quantization_config(checkpoint) is not None
    dtype = getattr(torch, profile.reference_dtype)
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    exact = switches.current("BEAM_EXACT_ROUNDING") if exact is None else exact
    if kv_scales is not None and not fp8:
        raise ValueError(f"{checkpoint}: the FP8 KV reference is for FP8 checkpoints")
    reference_kw = {} if fp8_max is None else {"fp8_max": fp8_max}
    model = (load_reference(checkpoint, dtype=dtype, exact=exact, kv_scales=kv_scales, **reference_kw) if fp8
             else load_oracle(checkpoint, dtype))
    floor_model = load_oracle(checkpoint, dtype if fp8 else other)
    name = (f"per-token FP8 reference (beam_hpu.reference.in_memory, BEAM_EXACT_ROUNDING={int(exact)})" if fp8
            else "transformers Beam")
    if kv_scales is not None:
        name += f", FP8 KV cache (scales of {kv_scales.source})"
    return {"format": FORMAT, "model": str(checkpoint), "reference": f"{name}, {profile.reference_dtype}",
            "topk": k, "gates": gates_of(profile),
            "passages": [reference_passage(model, ids, k, name, floor_model, scored)
                         for name, (ids, scored) in ((n, _ids_and_scored(p)) for n, p in passages.items())]}


def write_reference_file(checkpoint, passages: dict, path, profile, k: int = 20) -> None:
    Path(path).write_text(json.dumps(live_reference(checkpoint, passages, k, profile)) + "\n")
