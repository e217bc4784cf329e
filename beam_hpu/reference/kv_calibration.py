"""`beam-hpu calibrate-kv`: per-layer FP8 KV-cache scales from the ranges of K and V over passages,
computed by the streamed reference (`streamed.stream_layers`: the same reader, the same resumable
per-layer workdir, bounded memory, progress with an ETA) and written as an overlay of the
checkpoint (`kv_overlay`).

What is observed: the per-token FP8 reference stream (the served path's FP8 weights and activation
rounding, in `dtype`, activation range `fp8_max`), every attention layer's keys after k_norm and
RoPE, values, and queries after SSMax: exactly what vLLM's Beam hands its Attention layer, i.e.
what the cache stores (`kv_fp8`). K and V are not rounded while they are observed. The scale of a
layer is its |x| maximum over every position of every passage / 448 (`rounding.kv_cache_scale`),
no margin: a later token beyond the calibrated maximum saturates at +-fp8_max. q_scale is written
too: vLLM-CPU ignores it, vllm-gaudi's FP8 attention casts queries with it (with none it uses 1.0).

Everything that can be wrong with the input is refused before a weight is read: the target
(`kv_overlay.check_target`: not an FP8 compressed-tensors checkpoint, already calibrated, --out not
empty), then the passages and tensors (`plan.make_plan`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from beam_hpu.loader.options import LoaderOptions
from beam_hpu.loader.reader import RangeReader
from beam_hpu.quant.rounding import GAUDI2_FP8_MAX, kv_cache_scale
from beam_hpu.reference import kv_fp8
from beam_hpu.reference.kv_overlay import KINDS, check_target, write_overlay
from beam_hpu.reference.plan import Passage, make_plan
from beam_hpu.reference.streamed import stream_layers
from beam_hpu.reference.workdir import Workdir, fingerprint

logger = logging.getLogger("vllm.beam_hpu.reference")
TASK = "calibrate-kv"


def default_workdir(out: Path) -> Path:
    return out.with_name(out.name + ".kv-work")


def calibrate_kv(checkpoint: str | Path, passages: list[Passage], out: str | Path, *,
                 dtype: torch.dtype = torch.bfloat16, fp8_max: float = GAUDI2_FP8_MAX, exact: bool | None = None,
                 workdir: str | Path | None = None, stop_after_layer: int | None = None,
                 options: LoaderOptions | None = None, on_layer=None) -> dict | None:
    """Observe, write the overlay to `out`, return the per-layer table (None when stopped by
    `stop_after_layer`; the same call resumes). `fp8_max`: the activation rounding's range of the
    observed stream (240: Gaudi 2, the node's; 448: OCP); the written scales do not depend on it
    other than through the activations (their form is fixed by the readers, `kv_overlay`)."""
    src, out, _ = check_target(checkpoint, out)
    plan = make_plan(src, passages, dtype, fp8_max, exact)
    plan.streams = plan.streams[:1]  # the reference stream only: its floor model is not needed here
    plan.description["streams"] = plan.description["streams"][:1]
    plan.description["task"] = TASK
    work = Workdir(workdir or default_workdir(out), plan.description)
    model = plan.skeletons[plan.streams[0].dtype]
    options = options or LoaderOptions()
    try:
        with RangeReader(plan.checkpoint.files, options.num_threads, options.chunk_bytes) as reader:
            states = stream_layers(plan, work, reader, task=TASK, stop_after_layer=stop_after_layer,
                                   on_layer=on_layer,
                                   prepare=lambda states: kv_fp8.set_kv_observer(model, kv_fp8.amax_observer(states)))
    finally:
        kv_fp8.set_kv_observer(model, None)
    if states is None:
        return None
    table = {i: {kind: float(states[kv_fp8.range_key(kind, i)]) for kind in KINDS}
             for i in range(plan.config.num_hidden_layers)}
    scales = {i: {kind: kv_cache_scale(amax) for kind, amax in row.items()} for i, row in table.items()}
    tokens = sum(len(p.ids) for p in passages)
    meta = {"passages": str(len(passages)), "tokens": str(tokens), "dtype": str(dtype).removeprefix("torch."),
            "activation_fp8_max": f"{fp8_max:g}", "exact_rounding": str(int(plan.exact)),
            "run": fingerprint(plan.description), "amax": json.dumps(table)}
    write_overlay(src, out, scales, meta)
    logger.info("%s: wrote %s (%d layers, %d passages, %d tokens)", TASK, out, len(table), len(passages), tokens)
    return {"out": str(out), "amax": table, "scales": scales, "tokens": tokens}


def format_table(result: dict) -> str:
    lines = ["| layer | K amax | V amax | Q amax | k_scale | v_scale |", "|---|---|---|---|---|---|"]
    for i, row in sorted(result["amax"].items()):
        s = result["scales"][i]
        lines.append(f"| {i} | {row['k']:.4g} | {row['v']:.4g} | {row['q']:.4g} | {s['k']:.4g} | {s['v']:.4g} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- the command (beam_hpu.cli dispatches here)

def add_arguments(p) -> None:
    """  beam-hpu calibrate-kv CHECKPOINT (--passages FILE | --text F [--text F ...]) --out DIR
         [--fp8-max 240|448] [--dtype bfloat16|float32] [--workdir DIR] [--stop-after-layer K]"""
    p.add_argument("checkpoint", help="an FP8 (compressed-tensors) Beam checkpoint directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--passages", help="JSON: passage name -> token ids (or {token_ids, scored})")
    src.add_argument("--text", action="append",
                     help="a text file, one passage, tokenized with the checkpoint's tokenizer (repeatable)")
    p.add_argument("--out", required=True,
                   help="the overlay: the checkpoint directory itself (a shard added, config.json and the index "
                        "replaced, copies kept) or a new directory (symlinks to the checkpoint's other files)")
    p.add_argument("--fp8-max", type=float, choices=[240.0, 448.0], default=GAUDI2_FP8_MAX,
                   help="range of the per-token FP8 activation rounding of the observed model: 240 (Gaudi 2, "
                        "default) or 448 (OCP); the rounding follows BEAM_EXACT_ROUNDING as the server's does")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="precision of everything but the FP8 roundings (default bfloat16, the server's)")
    p.add_argument("--workdir", default=None, help="per-layer states, for resuming (default: OUT.kv-work)")
    p.add_argument("--stop-after-layer", type=int, default=None,
                   help="stop once this layer (0-based) is saved in the workdir; the same command resumes")


def run_cli(args) -> int:
    from beam_hpu.reference.plan import read_passages, text_passages
    from beam_hpu.reference.streamed import DTYPES

    handler = progress_to_stderr()
    try:
        # Refused before the passages are even tokenized: a wrong target is the cheapest error.
        check_target(args.checkpoint, args.out)
        passages = read_passages(args.passages) if args.passages else text_passages(args.checkpoint, args.text)
        result = calibrate_kv(args.checkpoint, passages, args.out, dtype=DTYPES[args.dtype], fp8_max=args.fp8_max,
                              workdir=args.workdir, stop_after_layer=args.stop_after_layer)
    finally:
        if handler is not None:
            logger.removeHandler(handler)
    if result is None:
        print(f"stopped after layer {args.stop_after_layer}; run the same command again to resume")
        return 0
    print(format_table(result))
    print(f"wrote {result['out']} ({result['tokens']} tokens observed); serve it with --kv-cache-dtype fp8_inc "
          f"(Gaudi) or fp8 (vLLM-CPU), and compare against `beam-hpu reference ... --kv-scales {result['out']}`")
    return 0


def progress_to_stderr():
    """A stderr handler on the reference logger when nothing (vLLM's logging) has set one up."""
    if logging.getLogger("vllm.beam_hpu").handlers or logging.getLogger("vllm").handlers:
        return None
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler
