"""What `vllm-router` costs and what its cache-aware policy buys, measured in one run.

    python benchmarks/router_overhead.py [--requests 16] [--prefixes 5] [--conversations 3] [--turns 2]

Starts two replicas of the tiny trained Beam (the demo's `vllm serve`, one core each) and
`vllm-router` in front (beam_hpu.replicas), then:

1. Latency: the same streamed chat requests sent one at a time directly to a replica and through
   the router, alternating which goes first; TTFT (first content or reasoning token) and total
   time, medians, ratio router / direct.
2. Prefix-cache hit rate: a workload of conversations sharing long prefixes (a system prompt and
   a tool list per "application", several multi-turn conversations each, turns in order but
   conversations interleaved at random), once through the cache-aware router and once through a
   round-robin router (the same replicas; each run uses its own prefixes so neither finds the
   other's cache). The rate is the replicas' own counters: prefix-cache hit tokens / queried
   tokens from /metrics, summed over replicas, for that run alone.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from beam_hpu.demo.serve import SERVED_NAME  # noqa: E402
from beam_hpu.replicas import metrics  # noqa: E402
from beam_hpu.replicas.layout import RouterSettings, plan, router_command  # noqa: E402
from beam_hpu.replicas.supervisor import Fleet  # noqa: E402
from beam_hpu.tiny.checkpoint import TRAINED_DIR  # noqa: E402

WORDS = ["Paris", "Rome", "Oslo", "Lima", "Bern", "Kyiv", "Cairo", "Quito", "Dakar", "Hanoi", "Sofia", "Minsk",
         "Accra", "Tunis", "Riga", "Baku", "Doha", "Male", "Suva", "Apia"]


def streamed(url: str, messages: list[dict], max_tokens: int, tools=None) -> tuple[float, float, str]:
    """(TTFT, total seconds, text) of one streamed chat request."""
    body = {"model": SERVED_NAME, "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": True}
    if tools:
        body["tools"] = tools
    start = time.perf_counter()
    first, text = None, ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            delta = choices[0].get("delta", {}) if choices else {}
            piece = (delta.get("content") or "") + (delta.get("reasoning") or "")
            if piece and first is None:
                first = time.perf_counter() - start
            text += piece
    total = time.perf_counter() - start
    return (first if first is not None else total), total, text


def latency(fleet: Fleet, n: int, max_tokens: int) -> dict:
    """Direct requests go to the replica the router sends these prompts to (the cache-aware policy
    keeps one-at-a-time requests sharing the chat scaffold on one replica), so both paths run on
    the same replica and core and differ only by the router."""
    router = fleet.layout.router_url
    before = [metrics.read(r.url) for r in fleet.layout.replicas]
    streamed(router, [{"role": "user", "content": "Repeat after me: warm"}], max_tokens)
    served = [(metrics.read(r.url) - b).requests for r, b in zip(fleet.layout.replicas, before)]
    direct = fleet.layout.replicas[served.index(max(served))].url
    runs = {"direct": [], "router": []}
    for k in range(n):
        messages = [{"role": "user", "content": f"Repeat after me: {WORDS[k % len(WORDS)]}"}]
        order = [("direct", direct), ("router", router)] if k % 2 == 0 else [("router", router), ("direct", direct)]
        for name, url in order:
            runs[name].append(streamed(url, messages, max_tokens)[:2])
    out = {"direct_url": direct}
    for name, samples in runs.items():
        out[name] = {"ttft_ms": 1000 * statistics.median(s[0] for s in samples),
                     "total_ms": 1000 * statistics.median(s[1] for s in samples)}
    return out


def tool(i: int, app: int) -> dict:
    return {"type": "function", "function": {"name": f"tool_{app}_{i}", "description": f"Tool {i} of application {app}.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                           "required": ["city"]}}}


def workload(prefixes: int, conversations: int, turns: int, seed: int) -> list[tuple[int, int]]:
    """The order of (conversation, turn) requests: conversations interleaved at random, turns in order."""
    rng = random.Random(seed)
    pending = {c: 0 for c in range(prefixes * conversations)}
    order = []
    while pending:
        c = rng.choice(sorted(pending))
        order.append((c, pending[c]))
        pending[c] += 1
        if pending[c] == turns:
            del pending[c]
    return order


def hit_rate(fleet: Fleet, tag: str, prefixes: int, conversations: int, turns: int, max_tokens: int) -> dict:
    systems = [f"[{tag} application {p}] You are the assistant of application {p}. " +
               " ".join(f"Policy {p}.{i}: keep answers short and repeat the user's word." for i in range(40))
               for p in range(prefixes)]
    tools = [[tool(i, p) for i in range(3)] for p in range(prefixes)]
    history: dict[int, list[dict]] = {}
    before = [metrics.read(r.url) for r in fleet.layout.replicas]
    for c, t in workload(prefixes, conversations, turns, seed=len(tag)):
        p = c % prefixes
        messages = history.setdefault(c, [{"role": "system", "content": systems[p]}])
        messages.append({"role": "user", "content": f"Repeat after me: {WORDS[(c * turns + t) % len(WORDS)]}"})
        _, _, text = streamed(fleet.layout.router_url, messages, max_tokens, tools=tools[p])
        messages.append({"role": "assistant", "content": text or "ok"})
    delta = [metrics.read(r.url) - b for r, b in zip(fleet.layout.replicas, before)]
    total = delta[0] + delta[1]
    return {"hit_rate": total.hit_rate, "hits": total.hits, "queries": total.queries,
            "requests_per_replica": [d.requests for d in delta]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16, help="latency: requests per path")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prefixes", type=int, default=5)
    ap.add_argument("--conversations", type=int, default=3, help="per prefix")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--router-port", type=int, default=8600)
    args = ap.parse_args()

    layout = plan(TRAINED_DIR, 2, router_port=args.router_port)
    fleet = Fleet(layout, tempfile.mkdtemp(prefix="router-bench-"))
    try:
        fleet.start()
        lat = latency(fleet, args.requests, args.max_tokens)
        aware = hit_rate(fleet, "aware", args.prefixes, args.conversations, args.turns, args.max_tokens)
        rr_cmd = router_command([r.url for r in layout.replicas], port=layout.router_port,
                                metrics_port=args.router_port + 3, settings=RouterSettings(policy="round_robin"))
        fleet.restart_router(rr_cmd)
        rr = hit_rate(fleet, "round-robin", args.prefixes, args.conversations, args.turns, args.max_tokens)
    finally:
        fleet.stop()

    d, r = lat["direct"], lat["router"]
    print(f"latency, {args.requests} streamed requests per path, {args.max_tokens} max tokens, medians "
          f"(direct: {lat['direct_url']}, the replica the router chose):")
    print(f"  TTFT   direct {d['ttft_ms']:.1f} ms, router {r['ttft_ms']:.1f} ms: "
          f"ratio {r['ttft_ms'] / d['ttft_ms']:.3f} (+{r['ttft_ms'] - d['ttft_ms']:.1f} ms)")
    print(f"  total  direct {d['total_ms']:.1f} ms, router {r['total_ms']:.1f} ms: "
          f"ratio {r['total_ms'] / d['total_ms']:.3f} (+{r['total_ms'] - d['total_ms']:.1f} ms)")
    n = args.prefixes * args.conversations * args.turns
    print(f"prefix-cache hit rate, {n} requests ({args.prefixes} shared prefixes x {args.conversations} "
          f"conversations x {args.turns} turns), replicas' /metrics:")
    for name, res in (("cache_aware", aware), ("round_robin", rr)):
        print(f"  {name:12s} {100 * res['hit_rate']:.1f}% ({res['hits']:.0f} / {res['queries']:.0f} tokens), "
              f"requests per replica {[int(x) for x in res['requests_per_replica']]}")
    print(f"  ratio cache_aware / round_robin: {aware['hit_rate'] / rr['hit_rate']:.3f}" if rr["hit_rate"] else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
