"""A stream held in flight on one replica, so that a fault lands mid-stream by construction, on
a host of any speed or load.

Once the stream's first token has reached the client, the engine cores it may be running on are
stopped (SIGSTOP): no further token can be made. What the engines had already sent is then drained
to the client, and the stream is checked to carry neither a finish_reason nor [DONE]. A fault
injected after that (the engine core or the API server killed, the replica's group stopped) lands
while the request is provably unfinished. Timing a kill by the client's reads or by the engine's
CPU time instead raced a fast host: the engine finished all its tokens before the kill landed. A
stream that ends before the stop fails the check (`StreamEnded`); it never passes vacuously.
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
    """A stream whose replica's engine core is stopped mid-generation (`replica`, `engine_pid`).
    `events` holds the stream's data events seen when it was checked unfinished."""

    case: Case
    replica: int
    engine_pid: int
    events_at_hold: int
    _reader: threading.Thread
    _outcome: list[Outcome] = field(default_factory=list)
    _lines: list[str] = field(default_factory=list)

    def release(self) -> None:
        """Continue the engine core (a no-op once it is gone)."""
        _signal(self.engine_pid, signal.SIGCONT)

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


def _running(url: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:num_requests_running")


def hold_stream(fleet: Fleet, base_url: str, case: Case, replicas: list[int], *, deadline: float = 120.0,
                quiet_secs: float = 1.0) -> HeldStream:
    """Stream `case` from `base_url` (a replica, or the router in front of `replicas`) and stop it
    mid-generation on the replica that runs it. With more than one candidate, every candidate's
    engine core is stopped at the first token, the one whose scheduler last reported the request
    running keeps stopped (vLLM's `vllm:num_requests_running`, which an idle engine's last step
    set to 0), the others are continued. Raises StreamEnded when the stream carried its end before
    the stop, AssertionError when no token came or the replica cannot be told."""
    engines = {i: procs.engine_core_pid(fleet.replica_procs[i].pid) for i in replicas}
    missing = [i for i, pid in engines.items() if pid is None]
    assert not missing, f"replicas {missing} have no engine core to hold the stream on"
    lines: list[str] = []
    outcome: list[Outcome] = []
    first_token, ended = threading.Event(), threading.Event()

    def on_line(line: str, state) -> None:
        lines.append(line)
        if state.chunks >= 1:
            first_token.set()

    def read() -> None:
        try:
            outcome.append(send(base_url, case, deadline, on_line=on_line))
        finally:
            ended.set()
            first_token.set()

    reader = threading.Thread(target=read, daemon=True, name=f"held-{case.name}")
    reader.start()
    assert first_token.wait(deadline), f"no token of {case.name!r} from {base_url} within {deadline:.0f}s"
    for pid in engines.values():
        _signal(pid, signal.SIGSTOP)
    try:
        # Drain what the engines sent before the stop: the API server forwards it, then goes quiet.
        seen, still = len(lines), time.monotonic()
        while time.monotonic() - still < quiet_secs and not ended.is_set():
            time.sleep(0.05)
            if len(lines) != seen:
                seen, still = len(lines), time.monotonic()
        if ended.is_set() or any(map(_ends, lines)):
            why = outcome[0].status if outcome else "no outcome"
            raise StreamEnded(f"{case.name!r} from {base_url} ended before its engine was stopped "
                              f"({len(lines)} data lines, {why}; last: {lines[-1:]}): a fault now would not land mid-stream")
        if len(engines) == 1:
            replica = next(iter(engines))
        else:
            running = [i for i in engines if _running(fleet.layout.replicas[i].url) >= 1]
            assert len(running) == 1, f"cannot tell which replica runs the held stream: running on {running}"
            replica = running[0]
        held = HeldStream(case, replica, engines[replica], len(lines), reader, outcome, lines)
    except BaseException:
        for pid in engines.values():
            _signal(pid, signal.SIGCONT)
        raise
    for i, pid in engines.items():
        if i != replica:
            _signal(pid, signal.SIGCONT)
    return held
