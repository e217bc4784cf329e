"""Stopping the processes tests start, and finding the ones they left.

vLLM engine cores have been seen ignoring SIGTERM, and an engine core whose API server died is
reparented away from the test that started it. So: servers and engines are started in their own
session (process group) and stopped by group, SIGTERM then SIGKILL; each pytest process becomes a
child subreaper, so an orphaned engine core stays its descendant; and at the end of the session
each pytest process (each xdist worker) names any engine, API server, router or replica still
alive below it (tests/conftest.py).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import time

import psutil

from beam_hpu.replicas.supervisor import stop_group as stop_process_group

# What a test-started serving process has in its command line: `vllm serve`, vLLM's engine core
# and workers (their process titles: VLLM::EngineCore, VLLM::Worker_TP0), vllm-router, and the
# project's own entry points (beam_hpu.cli demo, tests.support.engine_run).
OURS = re.compile(r"vllm|EngineCore|router|beam[-_]hpu|engine_run", re.IGNORECASE)

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphaned descendants of this process are reparented to it instead of to init (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def stop_group(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM the process group led by `proc` (started with start_new_session=True), wait up to
    `timeout` for the leader, then SIGKILL the group whatever the leader did: a member that ignored
    SIGTERM (an engine core) outlives its leader otherwise. Reaps the leader, and the members
    that, orphaned, were reparented to this process (a subreaper)."""
    members = group_members(proc.pid)
    stop_process_group(proc, signal.SIGTERM, grace=timeout)
    reap(members)


def group_members(pgid: int) -> list[int]:
    """The processes of group `pgid` but its leader."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != pgid and os.getpgid(p.pid) == pgid:
                found.append(p.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return found


def reap(pids: list[int], timeout: float = 10) -> None:
    """Collect the exit status of those of `pids` that are this process's children (orphans
    reparented here), once each has died: no Popen holds them, so nobody else would."""
    end = time.monotonic() + timeout
    for pid in pids:
        while True:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                break  # not ours (or already collected)
            if done or time.monotonic() >= end:
                break
            time.sleep(0.05)


def reap_zombie_children() -> None:
    """At the end of the session: collect every child that has exited (orphans reparented here)."""
    for p in psutil.Process().children():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(p.pid, os.WNOHANG)
        except (psutil.NoSuchProcess, ChildProcessError):
            continue


def kill_tree(pid: int, timeout: float = 30) -> None:
    """SIGTERM `pid` and all its descendants (whatever their process groups), SIGKILL what is left
    after `timeout`."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
            p.send_signal(signal.SIGCONT)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)


def serving_descendants(root_pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of each live descendant of `root_pid` that looks like ours (OURS)."""
    try:
        children = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for p in children:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.cmdline()) or p.name()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        if OURS.search(cmd):
            found.append((p.pid, cmd))
    return found


def leftovers(root_pid: int, grace: float = 10.0) -> list[tuple[int, str]]:
    """The serving processes still alive below `root_pid` after up to `grace` seconds (a stop in
    progress gets that long to finish)."""
    end = time.monotonic() + grace
    while True:
        found = serving_descendants(root_pid)
        if not found or time.monotonic() >= end:
            return found
        time.sleep(0.5)


def describe(found: list[tuple[int, str]]) -> str:
    return "\n".join(f"  pid {pid}: {cmd[:300]}" for pid, cmd in found)


def reap_leftovers(root_pid: int, grace: float = 10.0, term_timeout: float = 10.0) -> str:
    """The end-of-session check: kill the serving processes still alive below `root_pid` after
    `grace` (SIGTERM, SIGKILL after `term_timeout`) and return the failure message naming them
    ("" when there were none)."""
    found = leftovers(root_pid, grace)
    for pid, _ in found:
        kill_tree(pid, timeout=term_timeout)
    if root_pid == os.getpid():
        reap_zombie_children()
    if not found:
        return ""
    return "processes started by tests still alive at the end of the session (now killed):\n" + describe(found)
