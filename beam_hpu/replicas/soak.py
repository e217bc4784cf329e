"""The soak harness: a fleet under a fixed request mix, first unfaulted, then with faults on a
schedule, and the figures of both (benchmarks/soak.py prints them, tests/e2e/test_soak.py asserts
on them).

Phases, on one fleet started by `Fleet` and kept alive by `Supervisor`:
1. warm-up: every case once, one at a time (not counted);
2. unfaulted: `clients` threads cycle through the mix for `unfaulted_secs`; its greedy answers are
   the reference;
3. faulted: the same load while `FaultRunner` injects each fault of the schedule, one at a time,
   each once the fleet is healthy again (so faults never take every replica at once), and waits
   for the replica to come back; the phase ends `tail_secs` after the last recovery.
Then the load stops (clients finish the request in hand, bounded by the deadline) and the end
state is read: survivors' usage, requests still running on the replicas.

Survivors are the processes that lived through the faulted phase: the router and each replica
that was never restarted (a SIGSTOPped and continued replica keeps its processes). Their usage
is sampled every `sample_secs` (`procs.usage`, the process and its descendants).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from beam_hpu.replicas import procs
from beam_hpu.replicas.inflight import HeldStream, held_case, hold_stream_retrying
from beam_hpu.replicas.metrics import replica_gauge
from beam_hpu.replicas.soak_load import Case, Outcome, cases, send
from beam_hpu.replicas.supervisor import Fleet, Supervisor

FAULT_KINDS = ("kill_engine", "kill_api", "stop", "hang")
FIRST_FAULT = "first fault"  # a sampler phase: see growth_bounds


@dataclass(frozen=True)
class Fault:
    kind: str  # kill_engine: SIGKILL the engine core; kill_api: SIGKILL the API server (its leader);
    #            stop: SIGSTOP the replica's group for `hold_secs`, then SIGCONT; hang: SIGSTOP, never continued
    replica: int
    hold_secs: float = 0.0


@dataclass
class FaultRecord:
    fault: Fault
    injected: float
    left_router: bool = False  # the router listed the replica unhealthy at some poll after injection
    recovered: float | None = None  # the router lists it healthy again and its /health answers
    detail: str = ""
    held: str = ""  # how the stream held in flight on the replica when the fault landed ended (HELD_ENDS)

    @property
    def recovery_secs(self) -> float | None:
        return None if self.recovered is None else self.recovered - self.injected


# Each fault lands while a stream is held in flight on its replica (inflight.hold_stream: the engine
# core stopped at the stream's first token), so every fault is mid-stream on any host. How that
# stream must end: the engine's death as an SSE error event; the API server's as a connection cut
# under the client; a stop, continued, as a whole answer; a hang, cut when the supervisor kills it.
HELD_ENDS = {"kill_engine": ("error",), "kill_api": ("broken",), "stop": ("completed",), "hang": ("broken", "error")}
# Far more tokens than the engine can make in the slice it may run past what the client has seen
# (inflight.hold_stream; StreamEnded otherwise), few enough that a continued stop finishes it soon.
HELD_TOKENS = 1000


def default_schedule(health_interval_secs: float, health_failure_threshold: int) -> list[Fault]:
    """Replica 0: engine core killed, API server killed, hung (the supervisor restarts it each time).
    Replica 1: stopped for longer than the router needs to mark it unhealthy, then continued."""
    hold = health_interval_secs * (health_failure_threshold + 2)
    return [Fault("kill_engine", 0), Fault("stop", 1, hold), Fault("kill_api", 0), Fault("hang", 0)]


def router_setting(fleet: Fleet, flag: str) -> float:
    cmd = fleet.layout.router_cmd
    return float(cmd[cmd.index(flag) + 1])


def router_view(fleet: Fleet) -> dict[str, bool]:
    """url -> is_healthy, as the router's /workers lists them ({} when the router does not answer)."""
    try:
        workers = httpx.get(f"{fleet.layout.router_url}/workers", timeout=5).json().get("workers", [])
    except (httpx.HTTPError, ValueError):
        return {}
    return {w["url"]: bool(w.get("is_healthy")) for w in workers}


def router_counter(metrics_url: str, name: str) -> float:
    """Sum of a counter's samples on the router's Prometheus exporter (0 when not yet exported)."""
    try:
        text = httpx.get(metrics_url, timeout=5).text
    except httpx.HTTPError:
        return float("nan")
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


class Load:
    """`clients` threads sending the mix in a fixed order until `stop()`; every outcome is kept."""

    def __init__(self, url: str, mix: list[Case], clients: int, deadline: float, phase: str):
        self.url, self.mix, self.deadline, self.phase = url, mix, deadline, phase
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i, clients), daemon=True) for i in range(clients)]

    def _client(self, i: int, clients: int) -> None:
        k = i
        while not self._stop.is_set():
            out = send(self.url, self.mix[k % len(self.mix)], self.deadline)
            with self._lock:
                self.outcomes.append(out)
            k += clients

    def start(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def rounds(self) -> int:
        """How many times every case of the mix has been answered (the fewest of any case)."""
        with self._lock:
            seen = [o.case for o in self.outcomes]
        return min(seen.count(c.name) for c in self.mix)

    def completed(self) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if o.status == "completed")

    def run_for(self, secs: float, enough: Callable[[], bool], timeout: float) -> None:
        """Let the load run `secs`, then on until `enough()` holds or `timeout` seconds have passed
        in all: a phase measured in answers, not in seconds, asserts the same on a slow host."""
        start = time.monotonic()
        time.sleep(secs)
        while not enough() and time.monotonic() - start < timeout:
            time.sleep(0.5)

    def stop(self) -> None:
        """Ask the clients to stop and wait for the request each has in hand (at most its deadline)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.deadline + 30)


class FaultRunner:
    """Injects the schedule's faults one at a time and records when each replica comes back."""

    def __init__(self, fleet: Fleet, supervisor: Supervisor, schedule: list[Fault], *, gap_secs: float,
                 recover_timeout: float, on_recovered: Callable[[FaultRecord], None] | None = None):
        self.fleet, self.supervisor, self.schedule = fleet, supervisor, schedule
        self.gap_secs, self.recover_timeout = gap_secs, recover_timeout
        self.on_recovered = on_recovered
        self.records: list[FaultRecord] = []

    def _healthy(self, index: int) -> bool:
        r = self.fleet.layout.replicas[index]
        return (self.supervisor.watches[index].state == "running" and router_view(self.fleet).get(r.url) is True
                and procs.state(self.fleet.replica_procs[index].pid) not in (None, "T", "Z"))

    def _wait_all_healthy(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all(self._healthy(i) for i in self.supervisor.watches):
                return True
            time.sleep(0.5)
        return False

    def _back(self, rec: FaultRecord) -> bool:
        """A fault that ends the replica (kill, hang) is over once the supervisor has seen its
        restart healthy; a stop, once it is continued (the caller's `continued`)."""
        if rec.fault.kind == "stop":
            return True
        return any(e.action == "healthy" and e.at > rec.injected for e in self.supervisor.events_of(rec.fault.replica))

    def inject(self, fault: Fault) -> tuple[FaultRecord, HeldStream | None]:
        """Hold a stream in flight on the replica, then inject the fault (also when no stream could
        be held: the record says why, and summary_ok flags it)."""
        proc = self.fleet.replica_procs[fault.replica]
        held, why = None, ""
        try:
            held = hold_stream_retrying(self.fleet, self.fleet.layout.replicas[fault.replica].url,
                                        held_case(HELD_TOKENS, f"held-{fault.kind}"), [fault.replica])
        except AssertionError as e:
            why = f"no stream held: {e}"
        rec = FaultRecord(fault, time.monotonic(), held=why)
        if fault.kind == "kill_engine":
            pid = procs.engine_core_pid(proc.pid)
            if pid is None:
                rec.detail = "no engine core found"
            else:
                os.kill(pid, signal.SIGKILL)
                rec.detail = f"SIGKILL engine core pid {pid}"
        elif fault.kind == "kill_api":
            os.kill(proc.pid, signal.SIGKILL)
            rec.detail = f"SIGKILL API server pid {proc.pid}"
        elif fault.kind in ("stop", "hang"):
            os.killpg(proc.pid, signal.SIGSTOP)
            rec.detail = f"SIGSTOP group {proc.pid}" + (f" for {fault.hold_secs:.0f}s" if fault.kind == "stop" else "")
        else:
            raise ValueError(f"fault kind {fault.kind!r}: expected one of {FAULT_KINDS}")
        if held is not None and fault.kind in ("kill_engine", "kill_api"):
            held.release()  # what survives the kill runs on, as after an unheld fault
        return rec, held

    def run(self) -> None:
        for fault in self.schedule:
            if not self._wait_all_healthy(self.recover_timeout):
                self.records.append(FaultRecord(fault, time.monotonic(), detail="fleet not healthy: not injected"))
                continue
            time.sleep(self.gap_secs)
            rec, held = self.inject(fault)
            self.records.append(rec)
            url = self.fleet.layout.replicas[fault.replica].url
            continued = fault.kind != "stop"
            end = rec.injected + self.recover_timeout
            while time.monotonic() < end:
                now = time.monotonic()
                if not continued and now - rec.injected >= fault.hold_secs:
                    os.killpg(self.fleet.replica_procs[fault.replica].pid, signal.SIGCONT)
                    continued = True
                view = router_view(self.fleet)
                if view.get(url) is False:
                    rec.left_router = True
                if continued and self._back(rec) and self._healthy(fault.replica):
                    rec.recovered = time.monotonic()
                    if self.on_recovered is not None:
                        self.on_recovered(rec)
                    break
                time.sleep(0.5)
            if held is not None:
                try:
                    out, _ = held.finish(timeout=self.recover_timeout)
                    rec.held = f"{out.status}: {out.detail}"[:300] if out.detail else out.status
                except AssertionError as e:
                    rec.held = f"hung: {e}"


@dataclass
class Sampler:
    """Usage of the survivors every `every` seconds, per phase."""

    pids: dict[str, int]
    every: float
    samples: dict[str, list[tuple[str, procs.Usage]]] = field(default_factory=dict)
    phase: str = "start"

    def __post_init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def take(self) -> None:
        for name, pid in self.pids.items():
            self.samples.setdefault(name, []).append((self.phase, procs.usage(pid)))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.take()

    def start(self) -> "Sampler":
        self.take()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.take()


@dataclass
class SoakResult:
    unfaulted: list[Outcome]
    faulted: list[Outcome]
    faults: list[FaultRecord]
    events: list
    reference: dict[str, tuple]
    inconsistent: list[str]  # cases whose unfaulted answers differ among themselves (no reference)
    retries: dict[str, float]  # phase -> router retries (vllm_router_retries_total delta)
    usage: dict[str, list[tuple[str, procs.Usage]]]  # survivor -> [(phase, usage)]
    survivors: list[str]
    still_running: dict[str, float]  # replica url -> running + waiting requests at the end
    seconds: dict[str, float]


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in outcomes:
        out[o.status] = out.get(o.status, 0) + 1
    return out


def mismatches(outcomes: list[Outcome], reference: dict[str, tuple]) -> list[Outcome]:
    """Completed answers that differ from the unfaulted run's answer to the same case."""
    return [o for o in outcomes if o.status == "completed" and o.case in reference and o.answer != reference[o.case]]


def reference_answers(outcomes: list[Outcome]) -> tuple[dict[str, tuple], list[str]]:
    """The unfaulted answer per case, and the cases whose unfaulted answers disagree among themselves."""
    seen: dict[str, set] = {}
    for o in outcomes:
        if o.status == "completed":
            seen.setdefault(o.case, set()).add(o.answer)
    return {c: next(iter(a)) for c, a in seen.items() if len(a) == 1}, sorted(c for c, a in seen.items() if len(a) > 1)


def latency(outcomes: list[Outcome]) -> dict[str, float | None]:
    done = [o for o in outcomes if o.status == "completed"]
    ttft = [o.ttft for o in done if o.ttft is not None]
    secs = [o.seconds for o in done]
    return {"p50": percentile(secs, 0.5), "p99": percentile(secs, 0.99),
            "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99), "n": len(done)}


def run_soak(fleet: Fleet, supervisor: Supervisor, *, schedule: list[Fault], unfaulted_secs: float, tail_secs: float,
             clients: int, deadline: float, gap_secs: float, recover_timeout: float, metrics_url: str,
             sample_secs: float = 2.0, min_rounds: int = 0, min_faulted_completed: int = 0,
             phase_timeout: float = 900.0, log=print) -> SoakResult:
    """`unfaulted_secs` / `tail_secs`: the least each phase lasts. `min_rounds`: the unfaulted phase
    goes on until every case of the mix has been answered that many times; `min_faulted_completed`:
    the faulted phase's tail goes on until that many requests completed in it (each of the two at
    most `phase_timeout` seconds in all). With them, what the phases hold does not depend on the host's
    speed; a phase that still falls short shows in the counts."""
    mix = cases()
    url = fleet.layout.router_url
    t0 = time.monotonic()
    for case in mix:
        send(url, case, deadline)
    log(f"warm-up: {len(mix)} cases in {time.monotonic() - t0:.1f}s")
    pids = {"router": fleet.router_proc.pid}
    faulted_replicas = {f.replica for f in schedule if f.kind in ("kill_engine", "kill_api", "hang")}
    takes_one_out = [f for f in schedule if f.replica in faulted_replicas]
    for r in fleet.layout.replicas:
        if r.index not in faulted_replicas:
            pids[f"replica{r.index}"] = fleet.replica_procs[r.index].pid
    sampler = Sampler(pids, sample_secs)
    sampler.phase = "unfaulted"
    sampler.start()
    seconds, retries = {}, {}

    r0, t = router_counter(metrics_url, "vllm_router_retries_total"), time.monotonic()
    load = Load(url, mix, clients, deadline, "unfaulted").start()
    load.run_for(unfaulted_secs, lambda: load.rounds() >= min_rounds, phase_timeout)
    load.stop()
    seconds["unfaulted"] = time.monotonic() - t
    retries["unfaulted"] = router_counter(metrics_url, "vllm_router_retries_total") - r0
    log(f"unfaulted: {len(load.outcomes)} requests in {seconds['unfaulted']:.0f}s")
    reference, inconsistent = reference_answers(load.outcomes)

    # Until the first fault that ends another replica has recovered, a survivor's samples are part
    # of its reference: by then it has carried the whole load alone (growth_bounds).
    sampler.phase = FIRST_FAULT if takes_one_out else "faulted"

    def first_recovery(rec: FaultRecord) -> None:
        if rec.fault in takes_one_out and sampler.phase == FIRST_FAULT:
            sampler.phase = "faulted"

    r0, t = router_counter(metrics_url, "vllm_router_retries_total"), time.monotonic()
    faulted = Load(url, mix, clients, deadline, "faulted").start()
    runner = FaultRunner(fleet, supervisor, schedule, gap_secs=gap_secs, recover_timeout=recover_timeout,
                         on_recovered=first_recovery)
    runner.run()
    for rec in runner.records:
        log(f"fault {rec.fault.kind} on replica {rec.fault.replica}: {rec.detail}; "
            f"recovered in {rec.recovery_secs if rec.recovery_secs is None else round(rec.recovery_secs, 1)}s; "
            f"the stream held in flight: {rec.held}")
    faulted.run_for(tail_secs, lambda: faulted.completed() >= min_faulted_completed, phase_timeout)
    faulted.stop()
    seconds["faulted"] = time.monotonic() - t
    retries["faulted"] = router_counter(metrics_url, "vllm_router_retries_total") - r0
    sampler.phase = "end"
    time.sleep(sample_secs)  # let the replicas reap aborted requests before the end sample
    sampler.stop()
    still = {r.url: replica_gauge(r.url, "vllm:num_requests_running") + replica_gauge(r.url, "vllm:num_requests_waiting")
             for r in fleet.layout.replicas}
    survivors = [n for n, pid in pids.items() if procs.state(pid) not in (None, "Z")
                 and (n == "router" or fleet.replica_procs[int(n[7:])].pid == pid)]
    return SoakResult(load.outcomes, faulted.outcomes, runner.records, supervisor.events_of(), reference, inconsistent, retries,
                      sampler.samples, survivors, still, seconds)


def growth_bounds(samples: list[tuple[str, procs.Usage]]) -> tuple[procs.Usage, procs.Usage, procs.Usage]:
    """(first sample, last sample, the bound the last must stay under) of one survivor, measured in
    the same run and compared like with like. The reference is the survivor's peak over the
    unfaulted phase and the first fault (until the first replica taken out is back): by then it
    has carried the whole load alone, the heaviest it carries later. A replica's heap has a high
    water mark that rises with its concurrent requests and does not come down, so an end compared
    with the shared, unfaulted load alone measures the doubled load, not a leak (a CI run: +100 MiB
    of heap on the survivor, all of it while the other replica was down). The margin above the
    reference is the unfaulted phase's own spread (peak - lowest), at least 2% of the heap, 4 fds,
    2 threads. Memory is judged on the heap (`anon_mib`): code and mapped files paged in on first
    use (`file_mib`) are bounded by the files and are no leak; the total RSS is reported."""
    unf = [u for phase, u in samples if phase == "unfaulted"]
    ref = [u for phase, u in samples if phase in ("unfaulted", FIRST_FAULT)]

    def bound(get, floor):
        hi, lo = max(get(u) for u in unf), min(get(u) for u in unf)
        return max(get(u) for u in ref) + max(hi - lo, floor(hi))

    return samples[0][1], samples[-1][1], procs.Usage(
        max(u.rss_mib for u in ref), int(bound(lambda u: u.fds, lambda hi: 4)),
        int(bound(lambda u: u.threads, lambda hi: 2)), max(u.processes for u in unf),
        anon_mib=bound(lambda u: u.anon_mib, lambda hi: 0.02 * hi))


def fmt(x, unit="") -> str:
    return "n/a" if x is None else f"{x:.3f}{unit}" if unit == " s" else f"{x}{unit}"


def report(res: SoakResult) -> str:
    """The soak's table (markdown) and the facts under it."""
    lines = ["| | unfaulted | faulted |", "|---|---|---|"]
    cu, cf = counts(res.unfaulted), counts(res.faulted)
    rows = [("seconds", f"{res.seconds['unfaulted']:.0f}", f"{res.seconds['faulted']:.0f}"),
            ("requests sent", len(res.unfaulted), len(res.faulted))]
    for status in ("completed", "refused", "cancelled", "disconnected", "error", "broken", "truncated", "hung", "wrong"):
        rows.append((status, cu.get(status, 0), cf.get(status, 0)))
    rows.append(("router retries (vllm_router_retries_total)", f"{res.retries['unfaulted']:.0f}",
                 f"{res.retries['faulted']:.0f}"))
    lu, lf = latency(res.unfaulted), latency(res.faulted)
    for key, name in (("p50", "latency p50"), ("p99", "latency p99"), ("ttft_p50", "TTFT p50 (streams)"),
                      ("ttft_p99", "TTFT p99 (streams)")):
        rows.append((name, fmt(lu[key], " s"), fmt(lf[key], " s")))
    bad = mismatches(res.faulted, res.reference)
    same = sum(1 for o in res.faulted if o.status == "completed" and o.case in res.reference)
    rows.append(("completed greedy answers equal to the unfaulted run's", "(reference)",
                 f"{same - len(bad)}/{same}"))
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines += ["", "| fault | replica | stream in flight ended | router saw it leave | recovered after |",
              "|---|---|---|---|---|"]
    for rec in res.faults:
        kind = rec.fault.kind + (f" {rec.fault.hold_secs:.0f} s" if rec.fault.kind == "stop" else "")
        lines.append(f"| {kind} | {rec.fault.replica} | {rec.held[:60]} | {'yes' if rec.left_router else 'no'} | "
                     f"{fmt(rec.recovery_secs, ' s')} |")
    lines += ["", "| survivor | heap MiB start / end (bound) | RSS MiB start / end (reference peak) | "
                  "fds start / end (bound) | threads start / end (bound) |", "|---|---|---|---|---|"]
    for name in res.survivors:
        first, last, b = growth_bounds(res.usage[name])
        lines.append(f"| {name} | {first.anon_mib:.0f} / {last.anon_mib:.0f} ({b.anon_mib:.0f}) | "
                     f"{first.rss_mib:.0f} / {last.rss_mib:.0f} ({b.rss_mib:.0f}) | {first.fds} / {last.fds} "
                     f"({b.fds}) | {first.threads} / {last.threads} ({b.threads}) |")
    lines += ["", "| survivor | phase | samples | RSS MiB low-high | heap (anon) | file | shmem |", "|---|---|---|---|---|---|---|"]
    for name in res.survivors:
        for phase in dict.fromkeys(p for p, _ in res.usage[name]):
            us = [u for p, u in res.usage[name] if p == phase]
            span = lambda get: f"{min(map(get, us)):.0f}-{max(map(get, us)):.0f}"  # noqa: E731
            lines.append(f"| {name} | {phase} | {len(us)} | {span(lambda u: u.rss_mib)} | {span(lambda u: u.anon_mib)} | "
                         f"{span(lambda u: u.file_mib)} | {span(lambda u: u.shmem_mib)} |")
    for phase, outs in (("unfaulted", res.unfaulted), ("faulted", res.faulted)):
        failed: dict[tuple, list[Outcome]] = {}
        for o in outs:
            if o.status in ("error", "broken", "truncated", "hung", "wrong"):
                failed.setdefault((o.case, o.status), []).append(o)
        if failed:
            lines += ["", f"{phase} failures by case: " + "; ".join(
                f"{case} {status} x{len(os_)} (first: HTTP {os_[0].http}, {os_[0].detail[:160]})"
                for (case, status), os_ in sorted(failed.items()))]
    lines += ["", "supervisor events: " + "; ".join(f"replica {e.replica} {e.action} ({e.reason})" for e in res.events),
              "requests still running or waiting on the replicas at the end: "
              + ", ".join(f"{u}: {v:.0f}" for u, v in res.still_running.items())]
    return "\n".join(lines)


def summary_ok(res: SoakResult) -> list[str]:
    """What must hold; each failed check as one sentence (empty when all hold)."""
    problems = []
    for phase, outs in (("unfaulted", res.unfaulted), ("faulted", res.faulted)):
        lost = [o for o in outs if o.status in ("truncated", "hung", "wrong")]
        if lost:
            problems.append(f"{phase}: {len(lost)} lost requests: " + "; ".join(f"{o.case} {o.status} {o.detail}"
                                                                                  for o in lost[:5]))
    expected = {"complete": "completed", "refuse": "refused", "cancel": "cancelled", "disconnect": "disconnected"}
    by_name = {c.name: expected[c.expect] for c in cases()}
    off = [o for o in res.unfaulted if o.status != by_name[o.case]]
    if off:
        problems.append(f"unfaulted: {len(off)} requests did not end as their case expects: "
                        + "; ".join(f"{o.case} {o.status} {o.detail}" for o in off[:3]))
    if res.inconsistent:
        problems.append(f"unfaulted answers differ among themselves for {res.inconsistent}: no reference")
    bad = mismatches(res.faulted, res.reference)
    if bad:
        problems.append(f"{len(bad)} completed answers differ from the unfaulted run's: "
                        + "; ".join(f"{o.case}: {o.answer} != {res.reference[o.case]}" for o in bad[:3]))
    for rec in res.faults:
        if rec.held.split(":")[0] not in HELD_ENDS[rec.fault.kind]:
            problems.append(f"{rec.fault.kind} on replica {rec.fault.replica}: the stream held in flight ended "
                            f"{rec.held!r}, expected {' or '.join(HELD_ENDS[rec.fault.kind])}")
        if rec.recovered is None:
            problems.append(f"{rec.fault.kind} on replica {rec.fault.replica} did not recover ({rec.detail})")
    for name in res.survivors:
        _, last, b = growth_bounds(res.usage[name])
        if last.anon_mib > b.anon_mib or last.fds > b.fds or last.threads > b.threads:
            problems.append(f"{name} grew past its bound: end {last}, bound {b}")
    if any(v for v in res.still_running.values()):
        problems.append(f"requests left running on replicas: {res.still_running}")
    return problems
