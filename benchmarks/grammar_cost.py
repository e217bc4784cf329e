"""Cost of the always-on response grammar: aggregate chat tokens/s at 8 concurrent requests with
VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUT=1 vs 0, measured in one run, and the ratio.

    python benchmarks/grammar_cost.py [--model-dir DIR] [--concurrency 8] [--rounds 3]
    python benchmarks/grammar_cost.py --base-url-on URL --base-url-off URL --model NAME   # running servers

By default it serves the tiny trained Beam on CPU twice (`vllm serve` with the demo's flags), once
per setting, and sends the same chat requests (no tools, temperature 0, prompts the model answers
and closes) to each. Tokens are the servers' own `usage.completion_tokens`. The recipe measured
about 10% cost on Gaudi at 8 to 16 concurrent chat requests.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from beam_hpu.tiny import tasks as syn  # noqa: E402
from beam_hpu.gates.client import Endpoint  # noqa: E402


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        if k % 2:
            out.append(syn.echo_task(rng)[0])
        else:
            key, code = syn.random_key(rng), syn.random_code(rng)
            out.append(syn.needle_prompt("", key, code, 0.0))
    return out


def measure(ep: Endpoint, concurrency: int, rounds: int, max_tokens: int) -> dict:
    ps = prompts(concurrency * rounds)

    def one(p):
        r = ep.chat([{"role": "user", "content": p}], temperature=0.0, max_tokens=max_tokens)
        return r.usage.completion_tokens

    one(ps[0])  # warm-up (grammar compilation, first-request paths)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, ps))
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": wall, "tok_s": tokens / wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=None, help="checkpoint to serve (default: the tiny trained Beam)")
    ap.add_argument("--base-url-on", help="a running server with the grammar on")
    ap.add_argument("--base-url-off", help="a running server with the grammar off")
    ap.add_argument("--model", default="beam-tiny")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    results = {}
    for setting in ("1", "0"):
        url = args.base_url_on if setting == "1" else args.base_url_off
        server = None
        if url is None:
            from beam_hpu.tiny.checkpoint import TRAINED_DIR
            from tests.support.server import Server

            server = Server(args.model_dir or TRAINED_DIR, env={"VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUT": setting})
            url, model = server.base_url, server.model
        else:
            model = args.model
        try:
            results[setting] = measure(Endpoint(url, model), args.concurrency, args.rounds, args.max_tokens)
        finally:
            if server:
                server.stop()
        r = results[setting]
        print(f"VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUT={setting}: {r['tokens']} tokens in {r['seconds']:.2f} s = "
              f"{r['tok_s']:.1f} tok/s aggregate at {args.concurrency} concurrent chat requests", flush=True)
    ratio = results["1"]["tok_s"] / results["0"]["tok_s"]
    print(f"grammar on / off throughput ratio: {ratio:.3f} (cost {100 * (1 - ratio):+.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
