"""What keeps two pytest-xdist workers (`-n 2`, one per core) out of each other's way.

- Cores: vLLM-CPU binds a TP=1 engine's OpenMP threads to core 0 whatever else runs ("auto"
  binding reserves the last core), so two workers' engines would share one core and leave the
  other idle. Each worker's TP=1 engines get their own core instead; TP=2 engines take both.
- Multi-rank engines: one at a time across the workers (`both_cores`).
- Ports: each worker draws `vllm serve` ports and vLLM's internal ports (VLLM_PORT: the
  distributed init, the engine's sockets) from its own range, so two servers starting at once
  cannot pick the same free port.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile
from pathlib import Path

WORKER_PORT_SPAN = 4000
SERVE_PORT_BASE, VLLM_PORT_BASE = 20000, 42000


def worker_index() -> int:
    """0 without xdist; N for worker gwN."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


def engine_env(tp: int) -> dict[str, str]:
    """CPU binding and internal port range for an engine started by this worker."""
    cores = os.cpu_count() or 1
    if tp > 1:
        bind = "|".join(str(r % cores) for r in range(tp))
    else:
        bind = str(worker_index() % cores)
    return {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_PORT": str(VLLM_PORT_BASE + WORKER_PORT_SPAN * worker_index())}


def free_port() -> int:
    """A port of this worker's range that nothing listens on now."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct ports of this worker's range that nothing listens on now (a router and its
    replicas start together)."""
    start = SERVE_PORT_BASE + WORKER_PORT_SPAN * worker_index() + os.getpid() % (WORKER_PORT_SPAN // 2)
    found = []
    for port in range(start, start + WORKER_PORT_SPAN // 2):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == n:
            return found
    raise RuntimeError(f"fewer than {n} free ports in {start}..{start + WORKER_PORT_SPAN // 2}")


def both_cores_lock_path() -> Path:
    """One lock file per test run, shared by its xdist workers (they share PYTEST_XDIST_TESTRUNUID)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", f"pid{os.getpid()}")
    return Path(tempfile.gettempdir()) / f"beam-hpu-both-cores-{run}.lock"


@contextlib.contextmanager
def both_cores(tp: int):
    """Held while an engine with more than one rank runs (`tp` > 1), so that two such engines of two
    xdist workers never run at once. Each rank is bound to one core and they meet at every
    all-reduce; with another multi-rank engine on the same cores every meeting waits for the
    scheduler, and a TP 2 start measured 57 s alone took 274 s in the suite. A single-rank engine
    beside it costs it far less (76 s -> 102 s, measured), so those run freely."""
    if tp <= 1:
        yield
        return
    with open(both_cores_lock_path(), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
