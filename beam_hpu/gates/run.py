"""Run the gates: python -m beam_hpu.gates.run --base-url URL --model NAME [--only GATE ...]
[--profile cpu|gaudi] [--json OUT] [--reference-checkpoint DIR | --reference-file FILE]
[--reference-dtype bfloat16|float32].
Exit code 0 when every gate run passed."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback

from beam_hpu.gates import GATES
from beam_hpu.gates.client import Endpoint
from beam_hpu.gates.profile import PROFILES, get_profile
from beam_hpu.gates.result import GateResult, table, write_json


def run_gates(ep: Endpoint, profile, only=None, **options) -> list[GateResult]:
    results = []
    for name in only or GATES:
        if name not in GATES:
            raise ValueError(f"unknown gate {name!r}; choose from {GATES}")
        t0 = time.time()
        try:
            r = importlib.import_module(f"beam_hpu.gates.{name}").run(ep, profile, **options)
        except Exception as e:  # noqa: BLE001 - a crashed gate is a failed gate, the others still run
            r = GateResult(name, False, f"error: {type(e).__name__}: {e}"[:500], {"traceback": traceback.format_exc()})
        r.seconds = round(time.time() - t0, 1)
        results.append(r)
        print(f"[{name}] {'PASS' if r.passed else 'FAIL'} ({r.seconds}s): {r.result}", file=sys.stderr, flush=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--model", required=True, help="served model name")
    ap.add_argument("--only", action="append", choices=GATES, help="run only this gate (repeatable)")
    ap.add_argument("--profile", default="gaudi", choices=sorted(PROFILES))
    ap.add_argument("--json", default="gates.json", help="where to write the JSON report")
    ap.add_argument("--reference-checkpoint", help="perplexity: compute the reference live from this checkpoint")
    ap.add_argument("--reference-file", help="perplexity: stored reference figures (format in gates/perplexity.py)")
    ap.add_argument("--kv-scales", metavar="DIR",
                    help="perplexity, live reference: the server runs an FP8 KV cache with this calibrated "
                         "checkpoint's scales (beam-hpu calibrate-kv); the reference models the same cache")
    ap.add_argument("--reference-dtype", choices=("bfloat16", "float32"),
                    help="perplexity: precision of a live reference, the server's --dtype (default: the "
                         "profile's; cpu: float32, gaudi: bfloat16)")
    args = ap.parse_args(argv)
    ep = Endpoint(args.base_url, args.model)
    overrides = {"reference_dtype": args.reference_dtype} if args.reference_dtype else {}
    profile = get_profile(args.profile, **overrides)
    results = run_gates(ep, profile, args.only, reference_checkpoint=args.reference_checkpoint,
                        reference_file=args.reference_file, kv_scales=args.kv_scales)
    print(table(results))
    write_json(results, args.json, {"base_url": args.base_url, "model": args.model, "profile": args.profile})
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
