"""procs.cpu_seconds, which times test_soak's engine kill: it counts a process tree's own CPU time
(a busy child's, through its parent) and nothing for a sleeping one. Compared within one run, not
against wall-clock speed: a busy loop gets some CPU in a second on any host, a sleep gets none."""

import subprocess
import sys
import time

from beam_hpu.replicas import procs

BUSY = [sys.executable, "-c", "while True: pass"]
SLEEPING = [sys.executable, "-c", "import time; time.sleep(60)"]


def cpu_over(pid: int, seconds: float = 1.0) -> float:
    before = procs.cpu_seconds(pid)
    time.sleep(seconds)
    return procs.cpu_seconds(pid) - before


def test_a_busy_tree_counts_cpu_time_and_a_sleeping_one_none():
    # The busy loop runs as a grandchild (a shell's child), as vLLM's worker runs under its engine core.
    shell = subprocess.Popen(["sh", "-c", " ".join(f"'{a}'" for a in BUSY) + "; true"])
    sleeper = subprocess.Popen(SLEEPING)
    try:
        deadline = time.monotonic() + 30
        while not procs.descendants(shell.pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # past the sleeper's interpreter start-up
        busy, idle = cpu_over(shell.pid), cpu_over(sleeper.pid)
        assert busy >= 0.05 and idle <= 0.01, (busy, idle)
        assert procs.cpu_seconds(shell.pid) >= busy  # a running total, not a rate
    finally:
        for p in (shell, sleeper):
            for pid in procs.descendants(p.pid):
                subprocess.run(["kill", "-9", str(pid)], check=False)
            p.kill()
            p.wait()
    assert procs.cpu_seconds(shell.pid) == 0.0  # a process gone counts nothing
