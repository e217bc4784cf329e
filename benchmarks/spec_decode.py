"""Decode speed with and without speculative decoding on the tiny trained Beam, through `vllm serve`.

    python3 benchmarks/spec_decode.py                       # none vs ngram
    python3 benchmarks/spec_decode.py --spec eagle3='{"method": "eagle3", "model": "/path", ...}'
    python3 benchmarks/spec_decode.py --json OUT.json --requests 4

One server per configuration, one after the other (the demo's command line plus
`--speculative-config JSON`; `none` is the plain server and always runs first). Per workload and
stream count: completion tokens per second of wall time over the same requests (temperature 0),
and the mean accepted length from the server's own /metrics counters
(1 + accepted draft tokens / drafts, the tokens a verify step emits). Ratios are against `none`
from the same run. Workloads:
- copy: a filler passage restarted at its end, continued for 64 tokens (the copy gate's shape;
  ngram's best case);
- tool call: the tools gate's weather question with tools, tool_choice auto;
- reasoning: the smoke prompts (reason, then answer).
Speeds depend on the host; only the ratios of one run mean anything.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
WORKLOADS = ("copy", "tool call", "reasoning")
COPY_TOKENS, COPY_PASSAGE, COPY_RESTART = 64, 240, 8


def spec_counters(port: int) -> tuple[float, float]:
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text

    def total(name):
        m = re.search(rf"^vllm:spec_decode_{name}_total{{[^}}]*}} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return total("num_drafts"), total("num_accepted_tokens")


def make_requests(ep, profile, n: int) -> dict:
    """Per workload, n request thunks returning completion tokens (the same n for every config)."""
    from beam_hpu.gates import tools as tools_gate
    from beam_hpu.gates.common import Filler, user
    from beam_hpu.tiny import tasks as syn

    filler = Filler(ep, profile.pieces(), 41)
    passages = [filler.ids(COPY_PASSAGE) for _ in range(n)]

    def copy(i):
        p = passages[i]
        r = ep.client.completions.create(model=ep.model, prompt=p + p[:COPY_RESTART], max_tokens=COPY_TOKENS,
                                         temperature=0.0, extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    cities = [c for c in syn.CITIES][:max(n, 1)]

    def tool(i):
        r = ep.chat(user(syn.weather_prompt(cities[i % len(cities)], 3)), tools=tools_gate.TOOLS, tool_choice="auto",
                    temperature=0.0, max_tokens=profile.tools_max_tokens)
        return r.usage.completion_tokens

    prompts = [p for p, _ in profile.smoke_prompts]

    def reasoning(i):
        r = ep.chat(user(prompts[i % len(prompts)]), temperature=0.0, max_tokens=profile.max_tokens_chat)
        return r.usage.completion_tokens

    return {"copy": copy, "tool call": tool, "reasoning": reasoning}


def measure(call, streams: int, n: int) -> tuple[float, int]:
    """(completion tokens per second, tokens): `streams` threads, each running requests
    i = stream, stream + streams, .. < n * streams."""
    tokens = [0] * streams

    def worker(s):
        for i in range(s, n * streams, streams):
            tokens[s] += call(i % n)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return sum(tokens) / wall, sum(tokens)


def run_config(name: str, spec: dict | None, n: int, stream_counts: list[int]) -> dict:
    from beam_hpu.gates.client import Endpoint
    from beam_hpu.gates.profile import get_profile
    from beam_hpu.tiny.checkpoint import TRAINED_DIR
    from tests.support.server import Server

    extra = [] if spec is None else ["--speculative-config", json.dumps(spec)]
    server = Server(TRAINED_DIR, extra=extra)
    try:
        ep = Endpoint(server.base_url, server.model)
        calls = make_requests(ep, get_profile("cpu"), n)
        rows = {}
        for workload in WORKLOADS:
            calls[workload](0)  # warm: grammar compile, first-shape costs
            for streams in stream_counts:
                drafts0, accepted0 = spec_counters(server.port)
                speed, tokens = measure(calls[workload], streams, n)
                drafts, accepted = spec_counters(server.port)
                d = drafts - drafts0
                rows[f"{workload}|{streams}"] = {"tok_s": speed, "tokens": tokens,
                                                 "mean_accepted_length": 1 + (accepted - accepted0) / d if d else None}
                print(f"  {name:>8} {workload:>10} x{streams}: {speed:7.1f} tok/s ({tokens} tokens)", flush=True)
        return rows
    finally:
        server.stop()


def parse_spec(text: str) -> tuple[str, dict]:
    name, sep, body = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--spec wants NAME=JSON, got {text!r}")
    try:
        return name, json.loads(body)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--spec {name}: not JSON ({e})") from e


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", action="append", type=parse_spec, default=None,
                    help="NAME=JSON speculative config to compare (repeatable; default ngram k=4, lookup 2..4)")
    ap.add_argument("--requests", type=int, default=3, help="requests per stream per workload")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    configs = [("none", None)] + (args.spec or [("ngram", NGRAM)])
    stream_counts = [int(s) for s in args.streams.split(",")]
    results = {}
    for name, spec in configs:
        print(f"config {name}: {json.dumps(spec)}", flush=True)
        results[name] = run_config(name, spec, args.requests, stream_counts)
    base = results["none"]
    print(f"\n| workload | streams | none tok/s | " + " | ".join(f"{n} tok/s | {n} ratio | {n} accepted len"
                                                         for n, _ in configs[1:]) + " |")
    print("|---" * (3 + 3 * (len(configs) - 1)) + "|")
    for key, row in base.items():
        workload, streams = key.split("|")
        cells = [workload, streams, f"{row['tok_s']:.1f}"]
        for name, _ in configs[1:]:
            r = results[name][key]
            mal = r["mean_accepted_length"]
            cells += [f"{r['tok_s']:.1f}", f"{r['tok_s'] / row['tok_s']:.2f}x", "-" if mal is None else f"{mal:.2f}"]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"configs": dict(configs), "results": results}, indent=2))
    return results


if __name__ == "__main__":
    main()
