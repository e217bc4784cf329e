"""The end-of-session check of tests/conftest.py (tests/support/reaper.py), on planted processes:
it names a serving process a test left (also one orphaned by its parent), ignores processes that
are not serving ones, and the group stop kills a member that ignores SIGTERM. Every planted
process is gone when each test ends, so the real session's check stays clean."""

import os
import subprocess
import sys
import time

import psutil

from tests.support.reaper import become_subreaper, reap_leftovers, serving_descendants, stop_group

# A stand-in for an engine core: sleeps, ignoring SIGTERM, under the title vLLM gives its engine.
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"


def plant(*args, **kw) -> subprocess.Popen:
    kw.setdefault("stdout", subprocess.DEVNULL)
    return subprocess.Popen([*args], stderr=subprocess.DEVNULL, **kw)


def wait_for(pred, timeout=20):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end
        time.sleep(0.1)


def test_the_check_names_a_left_engine_and_kills_it_but_not_other_children():
    engine = plant(sys.executable, "-c", STUBBORN, "VLLM::EngineCore", start_new_session=True)
    other = plant("sleep", "300")
    try:
        wait_for(lambda: engine.pid in dict(serving_descendants(os.getpid())))
        problem = reap_leftovers(os.getpid(), grace=0.5, term_timeout=1)
        assert f"pid {engine.pid}: " in problem and "VLLM::EngineCore" in problem, problem
        assert f"pid {other.pid}:" not in problem
        assert engine.wait(15) is not None  # killed, although it ignores SIGTERM
        assert other.poll() is None
        assert reap_leftovers(os.getpid(), grace=0.5, term_timeout=1) == ""
    finally:
        for p in (engine, other):
            p.kill()
            p.wait()


def test_an_engine_orphaned_by_its_server_is_still_found():
    """The server (here a shell) exits and leaves its engine running: with this process a child
    subreaper (tests/conftest.py), the engine is reparented here, not to init."""
    assert become_subreaper()
    shell = plant("bash", "-c", f"{sys.executable} -c '{STUBBORN}' vllm-orphan >/dev/null 2>&1 & echo $!", stdout=subprocess.PIPE,
                  start_new_session=True)
    orphan = int(shell.stdout.readline())
    shell.wait(10)
    try:
        wait_for(lambda: orphan in dict(serving_descendants(os.getpid())))
        problem = reap_leftovers(os.getpid(), grace=0.5, term_timeout=1)
        assert f"pid {orphan}: " in problem and "vllm-orphan" in problem, problem
        wait_for(lambda: not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE)
    finally:
        try:
            os.kill(orphan, 9)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(orphan, 0)  # reparented here: ours to reap
        except ChildProcessError:
            pass


def test_group_stop_kills_a_member_that_ignores_sigterm():
    """A leader that exits on SIGTERM and a member that ignores it (the engine core seen doing so):
    stopping the group leaves neither."""
    leader = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; "
                               f"p = subprocess.Popen([sys.executable, '-c', {STUBBORN!r}, 'EngineCore']); "
                               f"print(p.pid, flush=True); time.sleep(300)"],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    member = int(leader.stdout.readline())
    try:
        stop_group(leader, timeout=5)
        wait_for(lambda: not psutil.pid_exists(member) or psutil.Process(member).status() == psutil.STATUS_ZOMBIE)
    finally:
        leader.kill()
        leader.wait()
        try:
            os.kill(member, 9)
        except ProcessLookupError:
            pass
