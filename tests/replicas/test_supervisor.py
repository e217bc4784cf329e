"""The fleet's Supervisor acting on real processes: a small HTTP server stands in for `vllm serve`
(it answers /health 200, in its own process group like a replica), so the restart loop, the
process-group handling and the events are exercised in seconds. The vLLM replicas under the
same supervisor: tests/e2e/test_soak.py."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from beam_hpu.replicas import procs
from beam_hpu.replicas.layout import Layout, Replica
from beam_hpu.replicas.restart import RestartPolicy
from beam_hpu.replicas.supervisor import Fleet, Supervisor, http_ok
from tests.support.parallel import free_ports

# A server with a child (as vllm serve has its engine core), answering GET /health with 200.
SERVER = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

POLICY = RestartPolicy(unhealthy_after_secs=3, startup_timeout_secs=60, backoff_initial_secs=0.5,
                       backoff_max_secs=2, max_restarts=3, window_secs=600, health_timeout_secs=1, poll_secs=0.3)


@pytest.fixture
def fleet(tmp_path):
    ports = free_ports(2)
    replicas = [Replica(i, p, 0, [sys.executable, "-c", SERVER, str(p)], dict(os.environ)) for i, p in enumerate(ports)]
    f = Fleet(Layout(replicas, 0, []), tmp_path)
    for r in replicas:
        f.start_replica(r)
    f.wait_replicas(60)
    sup = Supervisor(f, POLICY, log=None).start()
    yield f, sup
    sup.stop()
    f.stop()


def wait_for(pred, timeout=60):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end
        time.sleep(0.2)


def back(f, sup, index, old_pid):
    wait_for(lambda: any(e.action == "healthy" for e in sup.events_of(index)))
    assert f.replica_procs[index].pid != old_pid and http_ok(f"{f.layout.replicas[index].url}/health")


def test_a_killed_replica_is_restarted_and_its_orphan_child_removed(fleet):
    f, sup = fleet
    old = f.replica_procs[0]
    child = procs.descendants(old.pid)[0]
    os.kill(old.pid, signal.SIGKILL)  # the leader only: its child is left behind, as an engine core can be
    back(f, sup, 0, old.pid)
    assert procs.state(child) in (None, "Z")
    assert [e.action for e in sup.events_of(0)] == ["kill", "start", "healthy"]
    assert "process exited" in sup.events_of(0)[0].reason and sup.events_of(1) == []


def test_a_hung_replica_is_restarted_after_the_unhealthy_limit_and_a_short_pause_is_not(fleet):
    f, sup = fleet
    pid1 = f.replica_procs[1].pid
    os.killpg(pid1, signal.SIGSTOP)
    time.sleep(POLICY.unhealthy_after_secs / 3)
    os.killpg(pid1, signal.SIGCONT)
    time.sleep(POLICY.unhealthy_after_secs)
    assert sup.events_of(1) == [] and f.replica_procs[1].pid == pid1

    pid0 = f.replica_procs[0].pid
    os.killpg(pid0, signal.SIGSTOP)  # never continued
    back(f, sup, 0, pid0)
    assert "alive but /health failing" in sup.events_of(0)[0].reason
    assert procs.state(pid0) in (None, "Z")


def test_a_crash_loop_is_given_up_at_the_cap(fleet):
    f, sup = fleet
    for _ in range(POLICY.max_restarts):
        pid = f.replica_procs[0].pid
        os.kill(pid, signal.SIGKILL)
        back(f, sup, 0, pid)
        sup.events.clear()
    os.kill(f.replica_procs[0].pid, signal.SIGKILL)
    wait_for(lambda: any(e.action == "give_up" for e in sup.events_of(0)))
    time.sleep(1)
    assert f.replica_procs[0].poll() is not None and sup.watches[0].state == "given_up"
