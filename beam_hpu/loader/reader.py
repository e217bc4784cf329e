"""Parallel positional reads of byte ranges straight into host buffers.

No mmap: each range is read with `os.preadv` into the memory it belongs in (a parameter on CPU, a
staging buffer otherwise), so nothing is faulted in page by page and nothing is read twice.
Ranges that are adjacent in a file become one call (up to `chunk_bytes`); long ranges are split
so that one big tensor keeps every thread busy. The counters are the accounting the tests and
the benchmark check: bytes this process asked the kernel for, and how many calls.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

IOV_MAX = 1024  # Linux limit on buffers per preadv call


@dataclass
class ReadRequest:
    file: str
    offset: int
    dest: memoryview  # writable bytes; len(dest) bytes are read


def byte_view(t: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU tensor (no copy)."""
    assert t.is_contiguous() and t.device.type == "cpu", "byte_view needs a contiguous CPU tensor"
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _calls(requests: list[ReadRequest], chunk_bytes: int) -> list[tuple[str, int, list[memoryview]]]:
    """(file, offset, buffers) per preadv call: adjacent ranges joined, long ones split."""
    calls: list[tuple[str, int, list[memoryview]]] = []
    size = 0
    for r in sorted(requests, key=lambda r: (r.file, r.offset)):
        for start in range(0, len(r.dest), chunk_bytes):
            piece = r.dest[start:start + chunk_bytes]
            off = r.offset + start
            if calls and calls[-1][0] == r.file and calls[-1][1] + size == off \
                    and size + len(piece) <= chunk_bytes and len(calls[-1][2]) < IOV_MAX:
                calls[-1][2].append(piece)
                size += len(piece)
            else:
                calls.append((r.file, off, [piece]))
                size = len(piece)
    return calls


class RangeReader:
    def __init__(self, files: list[str], num_threads: int, chunk_bytes: int,
                 on_bytes: Callable[[int], None] | None = None):
        self.fds = {f: os.open(f, os.O_RDONLY) for f in files}
        self.pool = ThreadPoolExecutor(num_threads, thread_name_prefix="beam-loader-read")
        self.chunk_bytes = chunk_bytes
        self.on_bytes = on_bytes
        self.bytes_read = 0
        self.calls = 0
        self._lock = threading.Lock()

    def read(self, requests: list[ReadRequest]) -> None:
        """Fill every request's buffer; raises if any read fails or comes up short."""
        for _ in self.pool.map(self._read_call, _calls(requests, self.chunk_bytes)):
            pass

    def _read_call(self, call: tuple[str, int, list[memoryview]]) -> None:
        file, offset, buffers = call
        want = sum(len(b) for b in buffers)
        done, calls = 0, 0
        while buffers:
            n = os.preadv(self.fds[file], buffers, offset + done)
            calls += 1
            if n == 0:
                raise OSError(f"{file}: unexpected end of file at byte {offset + done} "
                              f"(wanted {want} bytes from {offset}); was the shard truncated while loading?")
            done += n
            buffers = _advance(buffers, n)
        with self._lock:
            self.bytes_read += want
            self.calls += calls
        if self.on_bytes:
            self.on_bytes(want)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for fd in self.fds.values():
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _advance(buffers: list[memoryview], n: int) -> list[memoryview]:
    """The buffers left after a short read of n bytes."""
    while buffers and n >= len(buffers[0]):
        n -= len(buffers[0])
        buffers = buffers[1:]
    if buffers and n:
        buffers = [buffers[0][n:]] + buffers[1:]
    return buffers
