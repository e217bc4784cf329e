"""`beam-hpu reference`: the perplexity gate's stored reference for a gate profile, written by the
streamed reference (`beam_hpu.reference.streamed`: layer by layer, resumable, bounded memory).

  beam-hpu reference CHECKPOINT (--passages FILE | --text F [--text F ...]) --out REF.json
      [--fp8-max 448|240] [--dtype bfloat16|float32] [--workdir DIR] [--topk 20] [--profile gaudi]
      [--stop-after-layer K] [--kv-scales DIR]

The profile (`beam_hpu.gates.profile`) sets the precision, the top-k and the bars the file carries;
what the run checks and computes is in `beam_hpu.reference.streamed`, the operator's guide in
`beam_hpu/reference/README.md`.
"""

from __future__ import annotations

import logging

from beam_hpu.gates.profile import get_profile


def add_arguments(p) -> None:
    p.add_argument("checkpoint")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--passages", help="JSON: passage name -> token ids (or {token_ids, scored})")
    src.add_argument("--text", action="append",
                     help="a text file, one passage, tokenized with the checkpoint's tokenizer (repeatable)")
    p.add_argument("--out", required=True, help="the reference file to write (beam-gates-reference/1)")
    p.add_argument("--fp8-max", type=float, choices=[448.0, 240.0], default=None,
                   help="FP8 e4m3 range of the activation rounding: 448 (OCP, default for an FP8 checkpoint) "
                        "or 240 (Gaudi 2); the rounding itself follows BEAM_EXACT_ROUNDING, as the "
                        "server's does (0, the recipe's, by default)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="precision of everything but the FP8 roundings (default: the profile's, bfloat16)")
    p.add_argument("--workdir", default=None, help="per-layer hidden states, for resuming (default: OUT.work)")
    p.add_argument("--topk", type=int, default=None, help="top-k stored per position (default: the profile's)")
    p.add_argument("--profile", default="gaudi", help="gate profile whose gates the file carries")
    p.add_argument("--stop-after-layer", type=int, default=None,
                   help="stop once this layer (0-based) is saved in the workdir; the same command resumes")
    p.add_argument("--kv-scales", default=None, metavar="DIR",
                   help="a checkpoint (or overlay) calibrated by `beam-hpu calibrate-kv`: the reference models an "
                        "FP8 KV cache with its per-layer scales (the reference of a server with --kv-cache-dtype "
                        "fp8_inc / fp8) and prints what FP8 KV costs against the same reference without it")


def run_cli(args) -> int:
    from beam_hpu.reference.kv_overlay import read_kv_scales
    from beam_hpu.reference.plan import read_passages, text_passages
    from beam_hpu.reference.streamed import DTYPES, write_streamed_reference

    # Progress on stderr when nothing (vLLM's logging) has set a handler up.
    log = logging.getLogger("vllm.beam_hpu.reference")
    handler = None
    if not logging.getLogger("vllm.beam_hpu").handlers and not logging.getLogger("vllm").handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    profile = get_profile(args.profile)
    dtype = DTYPES[args.dtype or profile.reference_dtype]
    kv_scales = read_kv_scales(args.kv_scales) if args.kv_scales else None  # refused before any weight read
    passages = read_passages(args.passages) if args.passages else text_passages(args.checkpoint, args.text)
    try:
        doc = write_streamed_reference(args.checkpoint, passages, args.out, dtype=dtype,
                                       fp8_max=args.fp8_max, workdir=args.workdir,
                                       k=args.topk or profile.ppl_topk, profile=profile,
                                       stop_after_layer=args.stop_after_layer, kv_scales=kv_scales)
    finally:
        if handler is not None:
            log.removeHandler(handler)
    print(f"wrote {args.out}" if doc is not None else f"stopped after layer {args.stop_after_layer}; "
          f"run the same command again to resume")
    if doc is not None and kv_scales is not None:
        print(kv_cost_table(doc))
    return 0


def kv_cost_table(doc: dict) -> str:
    """What FP8 KV costs per passage (scored positions), as the reference file records it."""
    lines = [f"FP8 KV cache (scales {doc['kv_fp8']['scales']}, range +-{doc['kv_fp8']['fp8_max']:g}) against the "
             f"same reference without it, on the scored positions:",
             "| passage | perplexity change | top-1 agreement | mean KL |", "|---|---|---|---|"]
    for p in doc["passages"]:
        c = p["kv_fp8_cost"]
        lines.append(f"| {p['name']} | {c['ppl_rel']:+.3%} | {c['top1']:.4f} | {c['kl']:.3g} |")
    return "\n".join(lines)
