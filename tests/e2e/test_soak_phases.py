"""The soak's phases end on answers, not only on time (beam_hpu/replicas/soak.py, Load.run_for):
no engine here, the load is sent to a port nothing listens on, so every request ends at once
(`broken`) and the counts grow as fast as the clients loop."""

import socket
import time

from beam_hpu.replicas.soak import Load
from beam_hpu.replicas.soak_load import cases


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # closed again: connections are refused


def test_a_phase_runs_on_past_its_seconds_until_every_case_was_answered_twice():
    load = Load(dead_url(), cases(), clients=3, deadline=5, phase="unfaulted").start()
    try:
        load.run_for(0.0, lambda: load.rounds() >= 2, timeout=60)
        assert load.rounds() >= 2
    finally:
        load.stop()
    assert {o.case for o in load.outcomes} == {c.name for c in cases()}


def test_a_phase_that_cannot_get_enough_ends_at_its_timeout():
    load = Load(dead_url(), cases(), clients=1, deadline=5, phase="faulted").start()
    try:
        start = time.monotonic()
        load.run_for(0.2, lambda: load.completed() >= 1, timeout=1.5)
        took = time.monotonic() - start
    finally:
        load.stop()
    assert load.completed() == 0
    assert 1.5 <= took < 30  # ends at the timeout (plus one poll), not when enough came
