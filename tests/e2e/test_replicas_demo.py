"""`beam-hpu demo --replicas 2` as a user runs it: it prints where each process runs, the README's
request works on the router's port, a replica killed under it comes back by itself (the demo's
supervisor), and SIGTERM stops every process it started (no orphans)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.engines import REPO
from tests.support.parallel import SERVE_PORT_BASE, WORKER_PORT_SPAN, worker_index
from tests.support.reaper import kill_tree

pytestmark = pytest.mark.slow


def free_run(n: int) -> int:
    """A port P with P..P+n-1 all free (the demo puts its replicas on the ports after its own)."""
    start = SERVE_PORT_BASE + WORKER_PORT_SPAN * worker_index() + WORKER_PORT_SPAN // 2 + os.getpid() % 1000
    for base in range(start, start + 1000, n):
        ok = True
        for port in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no run of free ports")


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() + " "
    except OSError:
        return ""


def ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_demo_replicas_serves_the_readme_request_and_stops_everything(tmp_path):
    port = free_run(4)
    proc = subprocess.Popen([sys.executable, "-m", "beam_hpu.cli", "demo", "--replicas", "2", "--port", str(port),
                             "--dir", str(tmp_path / "tiny")], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []

    def read():
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()

    def wait_line(text, timeout=600):
        deadline = time.monotonic() + timeout
        while not any(text in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.5)

    try:
        wait_line("Application startup complete")
        out = "".join(lines)
        assert f"replica 0: http://127.0.0.1:{port + 1} (core 0" in out
        assert f"replica 1: http://127.0.0.1:{port + 2} (core 1" in out
        assert f"router: http://127.0.0.1:{port}" in out
        # The README's two requests, as written (its sampling: the checkpoint's temperature).
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["beam-tiny"]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
            "model": "beam-tiny", "max_tokens": 32,
            "messages": [{"role": "user", "content": "Repeat after me: Paris"}]}).json()
        message = r["choices"][0]["message"]
        assert message["content"] and message["reasoning"], r
        # SIGKILL replica 0's API server (a crash): the demo's supervisor starts it again, unasked.
        replica0 = [p for p in descendants(proc.pid) if f"--port {port + 1} " in cmdline(p) and
                    "vllm serve" in cmdline(p) and ppid(p) == proc.pid]
        assert len(replica0) == 1, replica0
        os.kill(replica0[0], signal.SIGKILL)
        wait_line(f"supervisor: replica 0 (http://127.0.0.1:{port + 1}): start:")
        wait_line(f"supervisor: replica 0 (http://127.0.0.1:{port + 1}): healthy:")
        assert httpx.get(f"http://127.0.0.1:{port + 1}/health", timeout=10).status_code == 200
        started = descendants(proc.pid)
        assert len(started) >= 5  # router, 2 x (API server + engine core)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        deadline = time.monotonic() + 30
        while [p for p in started if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [p for p in started if alive(p)], "processes left after SIGTERM"
    finally:
        # The demo's replicas and router run in sessions of their own: kill by tree, not by group.
        kill_tree(proc.pid, timeout=30)
        proc.wait()
