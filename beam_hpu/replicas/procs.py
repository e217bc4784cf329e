"""A replica's processes as Linux shows them in /proc: its tree, its engine core, and what the
tree holds (resident memory, open file descriptors, threads, CPU time). Read-only."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
# vLLM 0.30 names its engine-core process (setproctitle): `VLLM::EngineCore`; /proc's comm keeps 15 bytes.
ENGINE_CORE_TITLE = "VLLM::EngineCore"


def _stat_fields(pid: int) -> list[str]:
    # The command name in /proc/PID/stat is in parentheses and may hold spaces: split after it.
    return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


def state(pid: int) -> str | None:
    """R, S, T (stopped), Z (zombie) ...; None when gone."""
    try:
        return _stat_fields(pid)[0]
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int(_stat_fields(int(entry.name))[1]), []).append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return sorted(out)


def cmdline(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def engine_core_pid(api_server_pid: int) -> int | None:
    """The engine-core child of a `vllm serve` API server, or None (not started yet, or dead)."""
    for pid in descendants(api_server_pid):
        if cmdline(pid).startswith(ENGINE_CORE_TITLE) and state(pid) not in (None, "Z"):
            return pid
    return None


def cpu_seconds(root_pid: int) -> float:
    """User + system CPU time of a process and its descendants so far (processes that have gone
    count nothing): the engine core's, read while its API server is too busy to answer /metrics."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in [root_pid, *descendants(root_pid)]:
        try:
            fields = _stat_fields(pid)
            total += int(fields[11]) + int(fields[12])  # utime, stime: /proc/PID/stat fields 14 and 15
        except (OSError, IndexError, ValueError):
            continue
    return total / tick


@dataclass(frozen=True)
class Usage:
    """Summed over a process tree. `rss_mib` is VmRSS; its parts: `anon_mib` (RssAnon: heaps, the
    only place a leak of objects or buffers lands), `file_mib` (RssFile: code and mapped files,
    paged in on first use and bounded by the files), `shmem_mib` (RssShmem: shared memory)."""

    rss_mib: float
    fds: int
    threads: int
    processes: int
    anon_mib: float = 0.0
    file_mib: float = 0.0
    shmem_mib: float = 0.0

    def __sub__(self, other: "Usage") -> "Usage":
        return Usage(self.rss_mib - other.rss_mib, self.fds - other.fds, self.threads - other.threads,
                     self.processes - other.processes, self.anon_mib - other.anon_mib,
                     self.file_mib - other.file_mib, self.shmem_mib - other.shmem_mib)


def usage(root_pid: int) -> Usage:
    """What `root_pid` and its descendants hold now (processes that vanish while read are skipped)."""
    rss_kib, fds, threads, n = 0, 0, 0, 0
    parts = {"RssAnon": 0, "RssFile": 0, "RssShmem": 0}
    for pid in [root_pid, *descendants(root_pid)]:
        try:
            status = (PROC / str(pid) / "status").read_text()
            fd_count = len(list((PROC / str(pid) / "fd").iterdir()))
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").strip().startswith("Z"):
            continue
        rss_kib += int(fields.get("VmRSS", "0 kB").split()[0])
        for key in parts:
            parts[key] += int(fields.get(key, "0 kB").split()[0])
        threads += int(fields.get("Threads", "0").strip())
        fds += fd_count
        n += 1
    return Usage(rss_kib / 1024, fds, threads, n, parts["RssAnon"] / 1024, parts["RssFile"] / 1024,
                 parts["RssShmem"] / 1024)
