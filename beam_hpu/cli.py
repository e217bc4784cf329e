"""`beam-hpu`: tiny checkpoints, the CPU demo and the stored reference. Parses and dispatches only.

  beam-hpu tiny DIR [--preset small|wide|trained] [--dtype bfloat16|float32] [--seed N] [--fp8]
  beam-hpu demo [--dir DIR] [--preset trained|small|wide] [--port 8000] [--tp 1] [--ep] [--fp8] [--draft [eagle3|dflash2]] [--print-only]
                [--replicas N [--policy cache_aware|round_robin|...]]
  beam-hpu reference CHECKPOINT (--passages FILE | --text F ...) --out REF.json [--fp8-max 448|240] [--workdir DIR]
                     [--kv-scales DIR]
  beam-hpu calibrate-kv CHECKPOINT (--passages FILE | --text F ...) --out DIR [--fp8-max 240|448] [--workdir DIR]
  beam-hpu card-check [--quick] [--cpu] [--out DIR] [--model PATH] [--switch NAME ...]

`tiny` and `demo`: `beam_hpu.demo.serve`; `demo --replicas`: `beam_hpu.replicas.demo`;
`reference`: `beam_hpu.gates.stored_reference`; `calibrate-kv`: `beam_hpu.reference.kv_calibration`;
`card-check`: `beam_hpu.cardcheck.run`.
"""

from __future__ import annotations

import argparse
import sys

from beam_hpu.demo.serve import DEFAULT_DEMO_DIR, PRESET_NAMES, demo_command, tiny_command


def _demo(args) -> int:
    if args.replicas > 1:
        from beam_hpu.replicas.demo import run

        return run(args)
    return demo_command(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="beam-hpu", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tiny", help="write a tiny deterministic Beam checkpoint")
    t.add_argument("dir")
    t.add_argument("--preset", default="small", choices=["trained", *PRESET_NAMES])
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--fp8", action="store_true", help="compressed-tensors FP8, as the published checkpoint")
    t.set_defaults(func=tiny_command)
    d = sub.add_parser("demo", help="write a tiny Beam and serve it with `vllm serve` on CPU")
    d.add_argument("--dir", default=str(DEFAULT_DEMO_DIR))
    d.add_argument("--preset", default="trained", choices=["trained", *PRESET_NAMES],
                   help="trained: the committed tiny trained Beam (default); others: random weights")
    d.add_argument("--port", type=int, default=8000)
    d.add_argument("--tp", type=int, default=1)
    d.add_argument("--ep", action="store_true", help="--enable-expert-parallel (use with --tp 2)")
    d.add_argument("--fp8", action="store_true", help="serve the FP8 tiny checkpoint")
    d.add_argument("--draft", nargs="?", const="eagle3", choices=["eagle3", "dflash2"],
                   help="speculative decoding with a committed tiny drafter: eagle3 (the default; "
                        "beam_hpu/tiny/data/trained_drafter) or dflash2 (beam_hpu/tiny/data/trained_dflash2)")
    d.add_argument("--print-only", action="store_true", help="print the serve command, do not run it")
    d.add_argument("--replicas", type=int, default=1,
                   help="N>=2: N replicas (ports PORT+1..PORT+N, one core each) behind vllm-router on PORT")
    d.add_argument("--policy", default="cache_aware", help="vllm-router --policy with --replicas (default cache_aware)")
    d.set_defaults(func=_demo)
    r = sub.add_parser("reference", help="write the perplexity gate's stored reference, streaming the "
                       "checkpoint layer by layer (resumable; beam_hpu.gates.stored_reference)")
    from beam_hpu.gates.stored_reference import add_arguments, run_cli

    add_arguments(r)
    r.set_defaults(func=run_cli)
    c = sub.add_parser("calibrate-kv", help="per-layer FP8 KV-cache scales from K/V ranges over passages, written "
                       "as an overlay of the checkpoint (streamed, resumable; beam_hpu.reference.kv_calibration)")
    from beam_hpu.reference import kv_calibration

    kv_calibration.add_arguments(c)
    c.set_defaults(func=kv_calibration.run_cli)
    k = sub.add_parser("card-check", help="measure on the Gaudi node each premise a switch waits on and print a "
                       "verdict per switch (beam_hpu/cardcheck/README.md)")
    from beam_hpu.cardcheck import run as card_check

    card_check.add_arguments(k)
    k.set_defaults(func=card_check.run_cli)
    args = parser.parse_args(argv)
    if argv is not None:  # called from Python: the caller gets the exception
        return args.func(args)
    try:
        return args.func(args)
    except ValueError as e:  # bad input (CheckpointError included): one line naming the culprit, no traceback
        print(f"beam-hpu {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
