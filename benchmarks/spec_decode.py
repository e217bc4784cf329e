"""Decode speed with and without speculative decoding on the tiny trained Beam, through `vllm serve`.

    python3 benchmarks/spec_decode.py                       # none vs ngram
    python3 benchmarks/spec_decode.py --spec eagle3='{"method": "eagle3", "model": "/path", ...}'
    python3 benchmarks/spec_decode.py --json OUT.json --requests 4 --rounds 5
    python3 benchmarks/spec_decode.py --preset all --streams 1   # every method in one run

One server per configuration (the demo's command line plus `--speculative-config JSON`; `none`
is the plain server), all started before anything is measured and alive together, each on the
same core; only one serves requests at a time. Measurements are interleaved: in each round, per
workload and stream count, every configuration runs the same requests back to back, in an order
that reverses every round (none, a, b / b, a, none / ...), so a drift of the host's speed falls
on all of them alike. A ratio is method tok/s / none tok/s of the same round; the table gives the
median over rounds and the range, and `none`'s own spread between rounds as the noise floor.
Completion tokens per second of wall time (temperature 0); the mean accepted length from the
server's own /metrics counters (1 + accepted draft tokens / drafts, the tokens a verify step
emits). Workloads:
- copy: a filler passage restarted at its end, continued for 64 tokens (the copy gate's shape;
  ngram's best case);
- tool call: the tools gate's weather question with tools, tool_choice auto;
- reasoning: the smoke prompts (reason, then answer).
Speeds depend on the host; only the ratios of one run mean anything.
"""
from __future__ import annotations

import argparse
import json
import os
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
IDLE_GAP_S = 2.0
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}


def all_methods() -> list[tuple[str, dict | None]]:
    """`--preset all`: a second plain server (its ratio is the run's noise floor), ngram, suffix
    and the committed tiny EAGLE3 and DFlash2 drafters, each as the demo serves it."""
    from beam_hpu.tiny.dflash2_drafter import speculative_config as dflash2
    from beam_hpu.tiny.drafter import speculative_config as eagle3

    return [("plain", None), ("ngram", NGRAM), ("suffix", SUFFIX), ("eagle3", json.loads(eagle3())),
            ("dflash2", json.loads(dflash2()))]


def spec_counters(port: int) -> tuple[float, float]:
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text

    def total(name):
        m = re.search(rf"^vllm:spec_decode_{name}_total{{[^}}]*}} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return total("num_drafts"), total("num_accepted_tokens")


def make_requests(ep, profile, n: int) -> dict:
    """Per workload, n request thunks returning (completion tokens, the answer: text, reasoning
    and tool calls), the same n for every config."""
    from beam_hpu.gates import tools as tools_gate
    from beam_hpu.gates.common import Filler, user
    from beam_hpu.tiny import tasks as syn

    filler = Filler(ep, profile.pieces(), 41)
    passages = [filler.ids(COPY_PASSAGE) for _ in range(n)]

    def copy(i):
        p = passages[i]
        r = ep.client.completions.create(model=ep.model, prompt=p + p[:COPY_RESTART], max_tokens=COPY_TOKENS,
                                         temperature=0.0, extra_body={"ignore_eos": True})
        return r.usage.completion_tokens, r.choices[0].text

    cities = [c for c in syn.CITIES][:max(n, 1)]

    def tool(i):
        r = ep.chat(user(syn.weather_prompt(cities[i % len(cities)], 3)), tools=tools_gate.TOOLS, tool_choice="auto",
                    temperature=0.0, max_tokens=profile.tools_max_tokens)
        return r.usage.completion_tokens, answer(r)

    prompts = [p for p, _ in profile.smoke_prompts]

    def reasoning(i):
        r = ep.chat(user(prompts[i % len(prompts)]), temperature=0.0, max_tokens=profile.max_tokens_chat)
        return r.usage.completion_tokens, answer(r)

    return {"copy": copy, "tool call": tool, "reasoning": reasoning}


def answer(r) -> str:
    m = r.choices[0].message
    extra = m.model_extra or {}
    calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
    return json.dumps([extra.get("reasoning") or extra.get("reasoning_content"), m.content, calls])


def measure(call, streams: int, n: int, answers: dict | None = None) -> tuple[float, int]:
    """(completion tokens per second, tokens): `streams` threads, each running requests
    i = stream, stream + streams, .. < n * streams; each request's answer into `answers[i % n]`
    (the last one seen)."""
    tokens = [0] * streams

    def worker(s):
        for i in range(s, n * streams, streams):
            count, text = call(i % n)
            tokens[s] += count
            if answers is not None:
                answers[i % n] = text

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return sum(tokens) / wall, sum(tokens)


def start_servers(configs, dtype: str = "float32") -> dict:
    from beam_hpu.tiny.checkpoint import TRAINED_DIR
    from tests.support.server import Server

    # The model worker binds itself to core 0 (tests.support.parallel.engine_env); the API server,
    # the engine-core process and this client go elsewhere. Left to the OS, the engine core's
    # polling lands on the worker's core now and then, and the same server's speed moved 25%
    # between rounds.
    cores = os.cpu_count() or 1
    host_cpus = set(range(1, cores)) if cores > 1 else None
    if host_cpus:
        os.sched_setaffinity(0, host_cpus)
    servers = {}
    try:
        for name, spec in configs:
            print(f"config {name}: {json.dumps(spec)}", flush=True)
            extra = ["--dtype", dtype] + ([] if spec is None else ["--speculative-config", json.dumps(spec)])
            servers[name] = Server(TRAINED_DIR, extra=extra, host_cpus=host_cpus)
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: dict):
    for server in servers.values():
        server.stop()


def median(values: list[float]) -> float:
    v = sorted(values)
    return (v[len(v) // 2] + v[(len(v) - 1) // 2]) / 2


def run_rounds(servers: dict, n: int, stream_counts: list[int], rounds: int, workloads=WORKLOADS) -> dict:
    """results[config][workload|streams] = {"tok_s": [per round], "tokens", "mean_accepted_length",
    "same_answers": how many of the n requests' answers equal none's (temperature 0: lossless
    drafting gives n, in fp32; see --dtype)}."""
    from beam_hpu.gates.client import Endpoint
    from beam_hpu.gates.profile import get_profile

    profile = get_profile("cpu")
    calls = {name: make_requests(Endpoint(s.base_url, s.model), profile, n) for name, s in servers.items()}
    names = list(servers)
    results = {name: {} for name in names}
    answers = {name: {} for name in names}
    for workload in workloads:
        for name in names:
            # Warm every request once: grammar compile, first-shape kernel costs, and the prefix
            # cache, which then holds the same prompts for every configuration.
            measure(calls[name][workload], 1, n, answers[name].setdefault(workload, {}))
        for streams in stream_counts:
            key = f"{workload}|{streams}"
            drafted = {name: [0.0, 0.0] for name in names}
            for r in range(rounds):
                for name in (names if r % 2 == 0 else names[::-1]):
                    # A server that just served keeps its worker polling for work on the shared
                    # core for a second (vLLM's shm_broadcast busy_loop_s = 1): measured here, it
                    # took a second of CPU from the next configuration's worker. Let it go idle.
                    time.sleep(IDLE_GAP_S)
                    port = servers[name].port
                    drafts0, accepted0 = spec_counters(port)
                    speed, tokens = measure(calls[name][workload], streams, n, answers[name][workload])
                    drafts, accepted = spec_counters(port)
                    drafted[name][0] += drafts - drafts0
                    drafted[name][1] += accepted - accepted0
                    row = results[name].setdefault(key, {"tok_s": [], "tokens": tokens})
                    row["tok_s"].append(speed)
                    print(f"  round {r + 1} {name:>8} {workload:>10} x{streams}: {speed:7.1f} tok/s ({tokens} tokens)",
                          flush=True)
            for name in names:
                d, a = drafted[name]
                results[name][key]["mean_accepted_length"] = 1 + a / d if d else None
                mine, plain = answers[name][workload], answers["none"][workload]
                results[name][key]["same_answers"] = sum(mine[i] == plain[i] for i in range(n))
                results[name][key]["requests"] = n
    return results


def print_table(results: dict, names: list[str]):
    base = results["none"]
    others = [n for n in names if n != "none"]
    print("\nratio = median over rounds of (method tok/s / none tok/s, same round) [min-max]; "
          "none spread = its slowest / fastest round")
    print("| workload | streams | none tok/s | none spread | " + " | ".join(
        f"{n} tok/s | {n} ratio | {n} accepted len | {n} same answers" for n in others) + " |")
    print("|---" * (4 + 4 * len(others)) + "|")
    for key, row in base.items():
        workload, streams = key.split("|")
        b = row["tok_s"]
        cells = [workload, streams, f"{median(b):.1f}", f"{min(b) / max(b):.2f}"]
        for name in others:
            r = results[name][key]
            ratios = [m / x for m, x in zip(r["tok_s"], b)]
            mal = r["mean_accepted_length"]
            cells += [f"{median(r['tok_s']):.1f}", f"{median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]",
                      "-" if mal is None else f"{mal:.2f}", f"{r['same_answers']}/{r['requests']}"]
        print("| " + " | ".join(cells) + " |")


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
    ap.add_argument("--preset", choices=("all",), help="all: plain (noise floor), ngram, suffix, EAGLE3 and "
                    "DFlash2 beside none, interleaved in one run (with --spec: added to them)")
    ap.add_argument("--requests", type=int, default=3, help="requests per stream per workload")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per workload and stream count")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="float32 (default): a verify step of k+1 rows costs about what a decode step costs, as "
                         "on Gaudi; bfloat16: on a CPU without AVX512-BF16 torch's bf16 matmul costs grow with "
                         "the rows, which taxes verification (benchmarks/README.md gives both)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    chosen = (all_methods() if args.preset == "all" else []) + (args.spec or [])
    configs = [("none", None)] + (chosen or [("ngram", NGRAM)])
    if len({name for name, _ in configs}) != len(configs):
        ap.error("--spec names must be distinct and not 'none'")
    stream_counts = [int(s) for s in args.streams.split(",")]
    workloads = [w.strip() for w in args.workloads.split(",")]
    if unknown := [w for w in workloads if w not in WORKLOADS]:
        ap.error(f"--workloads: unknown {unknown}; known: {', '.join(WORKLOADS)}")
    servers = start_servers(configs, args.dtype)
    try:
        results = run_rounds(servers, args.requests, stream_counts, args.rounds, workloads)
    finally:
        stop_servers(servers)
    print_table(results, [name for name, _ in configs])
    if args.json:
        args.json.write_text(json.dumps({"configs": dict(configs), "rounds": args.rounds, "dtype": args.dtype, "results": results},
                                        indent=2))
    return results


if __name__ == "__main__":
    main()
