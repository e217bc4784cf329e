"""The router's command for N Gaudi nodes, each one replica of the recipe (serving/multinode.md).

    python -m beam_hpu.replicas.multinode http://node1:8000 http://node2:8000 [--port 8000]

The same `router_command` as the CPU demo, with the values a node needs instead of loopback's:
health checked every 10 s (a node under a 250K-token prefill still answers /health; a dead
one is out within ~30 s, and the circuit breaker takes it out of routing at the first failed
requests before that), requests allowed an hour (the recipe's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS),
nodes allowed two hours to come up (its VLLM_ENGINE_READY_TIMEOUT_S), and balance at half a
replica's --max-num-seqs.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from beam_hpu.replicas.layout import POLICIES, RouterSettings, router_command

# A node is one replica of --max-num-seqs 16 (serving/recipe.yaml).
NODE_SETTINGS = RouterSettings(
    balance_abs_threshold=8,
    health_check_interval_secs=10,
    health_failure_threshold=3,
    health_success_threshold=2,
    health_check_timeout_secs=5,
    retry_max_retries=4,
    retry_initial_backoff_ms=200,
    retry_max_backoff_ms=5000,
    cb_failure_threshold=2,
    cb_timeout_duration_secs=60,
    request_timeout_secs=3600,
    # A node loads for 6 to 50 minutes (serving/multinode.md); the recipe gives the engine 7200 s.
    worker_startup_timeout_secs=7200,
    worker_startup_check_interval=10,
)


def node_router_command(node_urls: list[str], *, port: int = 8000, metrics_port: int = 29000,
                        policy: str = "cache_aware") -> list[str]:
    from dataclasses import replace

    return router_command(node_urls, port=port, metrics_port=metrics_port, host="0.0.0.0",
                          settings=replace(NODE_SETTINGS, policy=policy), executable="vllm-router")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("nodes", nargs="+", help="each node's `vllm serve` URL, e.g. http://node1:8000")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--metrics-port", type=int, default=29000)
    ap.add_argument("--policy", default="cache_aware", choices=POLICIES)
    args = ap.parse_args(argv)
    cmd = node_router_command(args.nodes, port=args.port, metrics_port=args.metrics_port, policy=args.policy)
    print(" \\\n  ".join(_pairs(cmd)))
    return 0


def _pairs(cmd: list[str]) -> list[str]:
    """One flag and its values per line."""
    lines, current = [], [cmd[0]]
    for a in cmd[1:]:
        if a.startswith("--"):
            lines.append(shlex.join(current))
            current = [a]
        else:
            current.append(a)
    return lines + [shlex.join(current)]


if __name__ == "__main__":
    sys.exit(main())
