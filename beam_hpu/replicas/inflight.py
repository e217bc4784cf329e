"""A stream held in flight on one replica, so that a fault lands mid-stream by construction, on
a host of any speed or load.

The engine cores the stream may run on are stopped (SIGSTOP) before it is sent and let run only in
short slices, each followed by a drain of what they sent to the client, until the client has seen
the stream's first event; they stay stopped then, so no further token can be made, and the stream
is checked to carry neither a finish_reason nor [DONE]. A fault
injected after that (the engine core or the API server killed, the replica's group stopped) lands
while the request is provably unfinished. Timing a kill by the client's reads or by the engine's
CPU time, or stopping the engine once the client had seen a token, raced a fast or loaded host: the
engine finished all its tokens while the client lagged. A stream that ends before the stop fails
the check (`StreamEnded`); it never passes vacuously.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from beam_hpu.demo.serve import SERVED_NAME
from beam_hpu.replicas import procs
from beam_hpu.replicas.metrics import replica_gauge
from beam_hpu.replicas.soak_load import Case, Outcome, send
from beam_hpu.replicas.supervisor import Fleet


def held_case(max_tokens: int, name: str = "held") -> Case:
    """A greedy stream that runs `max_tokens` tokens whatever the model says (the demo's context is
    4,096 tokens)."""
    return Case(name, {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Repeat after me: Paris"}],
                       "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, "stream": True})


class StreamEnded(AssertionError):
    """The stream finished before its engine was stopped: a fault now would not land mid-stream."""


@dataclass
class HeldStream:
    """A stream whose replica's engine core is stopped mid-generation (`replica`, `engine_pid`);
    `events_at_hold`: the data events the client had seen when it was checked unfinished."""

    case: Case
    replica: int
    engine_pid: int
    events_at_hold: int
    stopped: list[int]  # the engine core and its workers, all stopped
    _reader: threading.Thread
    _outcome: list[Outcome] = field(default_factory=list)
    _lines: list[str] = field(default_factory=list)

    def release(self) -> None:
        """Continue the engine core and its workers (a no-op once they are gone)."""
        for pid in self.stopped:
            _signal(pid, signal.SIGCONT)

    def finish(self, timeout: float) -> tuple[Outcome, list[str]]:
        """Wait for the stream to end; (what the client saw, every `data:` line it carried)."""
        self._reader.join(timeout)
        if self._reader.is_alive():
            raise AssertionError(f"the held stream on replica {self.replica} did not end within {timeout:.0f}s")
        return self._outcome[0], list(self._lines)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _ends(line: str) -> bool:
    """A `data:` line that ends a stream: [DONE], or a choice with its finish_reason."""
    if line == "data: [DONE]":
        return True
    try:
        event = json.loads(line[6:])
    except ValueError:
        return False
    return any(c.get("finish_reason") for c in event.get("choices") or [])


def hold_stream(fleet: Fleet, base_url: str, case: Case, replicas: list[int], *, deadline: float = 120.0,
                slice_secs: float = 0.02, quiet_secs: float = 0.5) -> HeldStream:
    """Stream `case` from `base_url` (a replica, or the router in front of `replicas`) and hold it
    mid-generation on the replica that runs it.

    The candidates' engine cores are stopped before the request is sent and run only in slices of
    `slice_secs`, each followed by a drain (no new line for `quiet_secs`), until the client has seen
    the stream's first event: however fast the host, the engine is then at most one slice past what
    the client has seen (tens of tokens), not free to race to the end while the client lags. The
    stream is then checked to carry no end. With more than one candidate, the one whose scheduler
    last reported a request running stays stopped (vLLM's `vllm:num_requests_running`, which an idle
    engine's last step set to 0), the others are continued. Raises StreamEnded when the stream
    carried its end, AssertionError when no event came or the replica cannot be told."""
    engines = {i: procs.engine_core_pid(fleet.replica_procs[i].pid) for i in replicas}
    missing = [i for i, pid in engines.items() if pid is None]
    assert not missing, f"replicas {missing} have no engine core to hold the stream on"
    lines: list[str] = []
    outcome: list[Outcome] = []
    ended = threading.Event()

    def read() -> None:
        try:
            outcome.append(send(base_url, case, deadline, on_line=lambda line, _: lines.append(line)))
        finally:
            ended.set()

    # The engine core and its worker processes: vLLM-CPU runs the model in a `VLLM::Worker` child.
    trees = {i: [pid, *procs.descendants(pid)] for i, pid in engines.items()}

    def each(sig: int) -> None:
        for pids in trees.values():
            for pid in pids:
                _signal(pid, sig)
        if sig == signal.SIGSTOP:  # delivered asynchronously: wait until Linux shows every one stopped
            settle = time.monotonic() + 5
            while any(procs.state(pid) not in ("T", "t", None, "Z") for pids in trees.values() for pid in pids):
                assert time.monotonic() < settle, f"engine processes not stopped: {trees}"
                time.sleep(0.001)

    continued: list[str] = []  # engine processes found running while held: stopped again, and said

    def drain() -> None:
        seen, still = len(lines), time.monotonic()
        while time.monotonic() - still < quiet_secs and not ended.is_set():
            time.sleep(0.02)
            running = [pid for pids in trees.values() for pid in pids if procs.state(pid) not in ("T", "t", None, "Z")]
            if running:
                continued.append(f"{running} running {time.monotonic() - sent:.2f}s after the stream was sent")
                each(signal.SIGSTOP)
            if len(lines) != seen:
                seen, still = len(lines), time.monotonic()

    cpu0 = procs.cpu_seconds(next(iter(engines.values())))
    try:
        each(signal.SIGSTOP)
        reader = threading.Thread(target=read, daemon=True, name=f"held-{case.name}")
        sent = time.monotonic()
        reader.start()
        end, slices = time.monotonic() + deadline, 0
        while True:
            drain()
            if ended.is_set() or any(map(_ends, lines)):
                why = outcome[0].status if outcome else "no outcome"
                raise StreamEnded(f"{case.name!r} from {base_url} ended before its engine was stopped ({len(lines)} "
                                  f"data lines after {slices} slices, {why}; last: {lines[-1:]}; engine processes "
                                  f"{ {pid: procs.state(pid) for pids in trees.values() for pid in pids} }, "
                                  f"CPU s since the stream was sent: {procs.cpu_seconds(next(iter(engines.values()))) - cpu0:.2f}; "
                                  f"{time.monotonic() - sent:.2f}s since; found running while held: {continued or 'never'}): "
                                  f"a fault now would not land mid-stream")
            if lines:
                break
            assert time.monotonic() < end, f"no event of {case.name!r} from {base_url} within {deadline:.0f}s"
            each(signal.SIGCONT)
            time.sleep(slice_secs)
            each(signal.SIGSTOP)
            slices += 1
        if len(engines) == 1:
            replica = next(iter(engines))
        else:
            running = [i for i in engines if replica_gauge(fleet.layout.replicas[i].url, "vllm:num_requests_running") >= 1]
            assert len(running) == 1, f"cannot tell which replica runs the held stream: running on {running}"
            replica = running[0]
        held = HeldStream(case, replica, engines[replica], len(lines), trees[replica], reader, outcome, lines)
    except BaseException:
        each(signal.SIGCONT)
        raise
    for i, pids in trees.items():
        if i != replica:
            for pid in pids:
                _signal(pid, signal.SIGCONT)
    return held


def hold_stream_retrying(fleet: Fleet, base_url: str, case: Case, replicas: list[int], attempts: int = 3,
                         log=print, **kw) -> HeldStream:
    """hold_stream, with a fresh stream when one ended before it was held (StreamEnded, said in the
    log): a fault still lands only on a stream proven unfinished; after `attempts` the last
    StreamEnded is raised."""
    for attempt in range(1, attempts + 1):
        try:
            return hold_stream(fleet, base_url, case, replicas, **kw)
        except StreamEnded as e:
            log(f"hold attempt {attempt} of {attempts}: {e}")
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")
