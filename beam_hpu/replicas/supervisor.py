"""Start a `Layout` (replicas, then the router), wait for health, stop everything.

Each process runs in its own session (process group), so stopping one takes its children (vLLM's
engine core, the router's workers) with it; `stop()` terminates every group, waits, then kills
what is left. The demo calls `stop()` on Ctrl-C and SIGTERM: nothing outlives it.

`Supervisor` is the fleet's restart loop (a thread): it brings back a replica whose process
exited or whose /health keeps failing, with the backoff and cap of `restart.RestartPolicy`, and
logs why. The router needs no telling: its health check drops the replica and takes it back.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from beam_hpu.replicas.layout import Layout, Replica
from beam_hpu.replicas.restart import ReplicaWatch, RestartPolicy


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class Fleet:
    """The running replicas and router of one `Layout`. `log_dir` gets one log per process."""

    def __init__(self, layout: Layout, log_dir: str | Path, *, extra_env: dict[str, str] | None = None):
        self.layout = layout
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.extra_env = dict(extra_env or {})
        self.replica_procs: dict[int, subprocess.Popen] = {}
        self.router_proc: subprocess.Popen | None = None
        self._logs: list = []

    # processes

    def _spawn(self, cmd: list[str], env: dict[str, str], name: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "a")
        self._logs.append(log)
        return subprocess.Popen(cmd, env={**env, **self.extra_env}, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def log_text(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start_replica(self, replica: Replica) -> None:
        self.replica_procs[replica.index] = self._spawn(replica.cmd, replica.env, f"replica{replica.index}")

    def start(self, timeout: float = 600) -> "Fleet":
        """All replicas at once (each on its own core), then the router once they are healthy."""
        try:
            for r in self.layout.replicas:
                self.start_replica(r)
            self.wait_replicas(timeout)
            self.router_proc = self._spawn(self.layout.router_cmd, dict(os.environ), "router")
            self.wait_router(timeout=120)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_replicas(self, timeout: float, indices: list[int] | None = None) -> None:
        deadline = time.monotonic() + timeout
        pending = [self.layout.replicas[i] for i in (indices if indices is not None else self.replica_procs)]
        while pending:
            for r in list(pending):
                proc = self.replica_procs[r.index]
                if proc.poll() is not None:
                    raise RuntimeError(f"replica {r.index} (port {r.port}) exited with {proc.returncode}; its log "
                                       f"{self.log_dir / f'replica{r.index}.log'} ends:\n"
                                       f"{self.log_text(f'replica{r.index}')[-6000:]}")
                if http_ok(f"{r.url}/health"):
                    pending.remove(r)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"replicas {[r.index for r in pending]} not healthy after {timeout:.0f}s "
                                   f"(logs in {self.log_dir})")
            if pending:
                time.sleep(1)

    def router_ready(self) -> bool:
        """The router answers and lists the served model (it proxies /v1/models to a worker)."""
        return http_ok(f"{self.layout.router_url}/v1/models")

    def wait_router(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.router_ready():
            if self.router_proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.router_proc.returncode}:\n"
                                   f"{self.log_text('router')[-6000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm-router not ready after {timeout:.0f}s:\n{self.log_text('router')[-6000:]}")
            time.sleep(0.5)

    def restart_router(self, router_cmd: list[str], timeout: float = 120) -> None:
        """Replace the router (e.g. another policy) in front of the same running replicas."""
        if self.router_proc is not None:
            stop_group(self.router_proc, signal.SIGTERM)
        self.layout = dataclasses.replace(self.layout, router_cmd=list(router_cmd))
        self.router_proc = self._spawn(self.layout.router_cmd, dict(os.environ), "router")
        self.wait_router(timeout)

    def kill_replica(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Kill replica `index`'s whole process group (SIGKILL: a crash, not a graceful stop)."""
        stop_group(self.replica_procs[index], sig)

    def discard_replica(self, index: int) -> None:
        """SIGKILL what is left of replica `index`'s group (a dead leader can leave its engine core
        behind, a hung one answers nothing) and reap it, so a new one can take its ports."""
        stop_group(self.replica_procs[index], signal.SIGKILL, grace=5)

    def restart_replica(self, index: int, timeout: float = 600) -> None:
        self.kill_replica(index, signal.SIGTERM)
        self.start_replica(self.layout.replicas[index])
        self.wait_replicas(timeout, [index])

    def stop(self) -> None:
        procs = [p for p in [self.router_proc, *self.replica_procs.values()] if p is not None]
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        for p in procs:
            stop_group(p, signal.SIGTERM)
        for log in self._logs:
            log.close()
        self._logs.clear()

    def describe(self) -> str:
        lines = [f"replica {r.index}: {r.url} (core {r.core}, log {self.log_dir / f'replica{r.index}.log'})"
                 for r in self.layout.replicas]
        lines.append(f"router: {self.layout.router_url} (log {self.log_dir / 'router.log'})")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Event:
    at: float  # time.monotonic()
    replica: int
    action: str  # "kill", "start", "give_up", "healthy"
    reason: str


class Supervisor:
    """Restarts the replicas of `fleet` by `policy`, in a daemon thread, until `stop()`.

    Every poll: is each replica's process alive, does its /health answer 200 within the policy's
    timeout. `ReplicaWatch` decides; this class acts (discard the old group, spawn the replica's
    command again) and records an `Event` for each action, printed to `log` as it happens."""

    def __init__(self, fleet: Fleet, policy: RestartPolicy = RestartPolicy(), log=sys.stderr):
        self.fleet, self.policy, self.log = fleet, policy, log
        now = time.monotonic()
        self.watches = {i: ReplicaWatch(policy, started_at=now) for i in fleet.replica_procs}
        self.events: list[Event] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="replica-supervisor", daemon=True)

    def start(self) -> "Supervisor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _record(self, index: int, action: str, reason: str) -> None:
        event = Event(time.monotonic(), index, action, reason)
        with self._lock:
            self.events.append(event)
        if self.log is not None:
            print(f"supervisor: replica {index} ({self.fleet.layout.replicas[index].url}): {action}: {reason}",
                  file=self.log, flush=True)

    def events_of(self, index: int | None = None) -> list[Event]:
        with self._lock:
            return [e for e in self.events if index is None or e.replica == index]

    def poll_once(self) -> None:
        for index, watch in self.watches.items():
            replica = self.fleet.layout.replicas[index]
            proc = self.fleet.replica_procs[index]
            alive = proc.poll() is None
            # A replica waiting out its backoff is not probed: it has no process.
            healthy = alive and watch.state != "backoff" and http_ok(f"{replica.url}/health",
                                                                     timeout=self.policy.health_timeout_secs)
            was = watch.state
            decision = watch.observe(time.monotonic(), alive, healthy)
            if decision.action == "kill":
                self.fleet.discard_replica(index)
                code = proc.returncode
                self._record(index, "kill", f"{decision.reason} (exit code {code})")
            elif decision.action == "start":
                self.fleet.start_replica(replica)
                self._record(index, "start", decision.reason)
            elif decision.action == "give_up":
                self.fleet.discard_replica(index)
                self._record(index, "give_up", decision.reason)
            elif was == "starting" and watch.state == "running" and watch.restarts:
                self._record(index, "healthy", f"healthy again after restart {watch.attempt}")

    def _run(self) -> None:
        while not self._stop.wait(self.policy.poll_secs):
            try:
                self.poll_once()
            except Exception as e:  # one bad poll (a /proc race) must not end the supervision
                print(f"supervisor: poll failed: {e!r}", file=self.log, flush=True)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def stop_group(proc: subprocess.Popen, sig: int, grace: float = 30) -> None:
    """Signal the group, wait `grace`, then SIGKILL the group; reap. The group is killed even when
    its leader already exited, so an engine child cannot outlive its `vllm serve`. SIGCONT after the
    signal: a stopped (SIGSTOPped) group would hold a SIGTERM until continued."""
    try:
        os.killpg(proc.pid, sig)
        os.killpg(proc.pid, signal.SIGCONT)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
