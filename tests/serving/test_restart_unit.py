"""The node's restart setup (serving/beam-replica.service, wait-ready.sh, health-watch.sh): the
scripts run against a real local HTTP server, and the unit's timeouts are the recipe's."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests.support.engines import REPO

SERVING = REPO / "serving"


class Health:
    """A /health that answers 503 `failures` times, then 200 (or 503 forever with None)."""

    def __init__(self, failures: int | None):
        self.failures, self.calls = failures, 0
        health = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                health.calls += 1
                ok = health.failures is not None and health.calls > health.failures
                self.send_response(200 if ok else 503)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/health"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def health(request):
    h = Health(request.param)
    yield h
    h.close()


@pytest.mark.parametrize("health", [3], indirect=True)
def test_wait_ready_returns_once_health_answers(health):
    r = subprocess.run(["bash", str(SERVING / "wait-ready.sh"), health.url, "60", "0.2"], capture_output=True,
                       text=True, timeout=90)
    assert r.returncode == 0 and r.stdout.startswith(f"ready: {health.url}"), r
    assert health.calls == 4


@pytest.mark.parametrize("health", [None], indirect=True)
def test_wait_ready_fails_after_its_timeout(health):
    r = subprocess.run(["bash", str(SERVING / "wait-ready.sh"), health.url, "1", "0.2"], capture_output=True,
                       text=True, timeout=60)
    # It gave up: exit 1 and the message. How many tries fit in the 1 s is the host's business (a
    # loaded host's first curl has taken the whole second; `date +%s` also counts whole seconds);
    # retrying is what the test above shows (three failed tries, then ready).
    assert r.returncode == 1 and "not ready" in r.stderr and health.calls >= 1


def fake_systemctl(tmp_path: Path, state: str) -> Path:
    """A `systemctl` that reports the unit `state` and records every other call."""
    exe = tmp_path / "systemctl"
    exe.write_text(f"#!/bin/bash\nif [ \"$1\" = is-active ]; then echo {state}; exit 0; fi\n"
                   f"echo \"$@\" >> {tmp_path / 'calls'}\n")
    exe.chmod(0o755)
    return exe


def watch(tmp_path, url, state, seconds):
    exe = fake_systemctl(tmp_path, state)
    proc = subprocess.Popen(["bash", str(SERVING / "health-watch.sh"), url, "beam-replica.service", "1", "0.2"],
                            env={"PATH": "/usr/bin:/bin", "SYSTEMCTL": str(exe)}, stdout=subprocess.PIPE, text=True)
    calls = tmp_path / "calls"
    end = time.monotonic() + seconds
    while time.monotonic() < end and not calls.exists():
        time.sleep(0.2)
    proc.kill()
    out = proc.communicate()[0]
    return (calls.read_text() if calls.exists() else ""), out


@pytest.mark.parametrize("health", [None], indirect=True)
def test_health_watch_restarts_an_active_unit_that_stopped_answering(health, tmp_path):
    calls, out = watch(tmp_path, health.url, "active", 60)
    assert calls.splitlines()[0] == "restart --no-block beam-replica.service", (calls, out)
    assert "failing for" in out


@pytest.mark.parametrize("health", [None], indirect=True)
def test_health_watch_leaves_a_loading_unit_alone(health, tmp_path):
    """`activating` (ExecStartPost still waiting for /health): no restart however long it takes.
    Watched for 4 s, four times the watch's 1 s limit."""
    calls, _ = watch(tmp_path, health.url, "activating", 4)
    assert calls == ""


def unit_value(text: str, key: str) -> str:
    return re.search(rf"^{key}=(.*)$", text, re.M).group(1).strip()


def test_unit_waits_the_recipes_engine_ready_timeout_and_restarts_with_a_cap():
    unit = (SERVING / "beam-replica.service").read_text()
    ready = int(yaml.safe_load((SERVING / "recipe.yaml").read_text())["env"]["VLLM_ENGINE_READY_TIMEOUT_S"])
    post = unit_value(unit, "ExecStartPost")
    assert post.endswith(f"serving/wait-ready.sh http://127.0.0.1:${{PORT}}/health {ready} 10")
    assert int(unit_value(unit, "TimeoutStartSec")) > ready
    assert unit_value(unit, "Restart") == "always"
    assert int(unit_value(unit, "StartLimitBurst")) == 5 and int(unit_value(unit, "StartLimitIntervalSec")) == 3600
    assert "/opt/gaudi-cookbook/serving/launch.sh ${MODEL_DIR} --host 0.0.0.0 --port ${PORT}" in unit
    watcher = (SERVING / "beam-replica-health.service").read_text()
    assert "serving/health-watch.sh http://127.0.0.1:8000/health beam-replica.service 120 10" in watcher
