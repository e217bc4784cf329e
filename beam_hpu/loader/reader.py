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


def _calls(requests: list[ReadRequest], chunk_bytes: int, max_gap: int = 0,
           gap_buffer: memoryview | None = None) -> list[tuple[str, int, list[memoryview], int]]:
    """(file, offset, buffers, gap bytes) per preadv call: ranges in one file joined when adjacent
    or separated by at most `max_gap` bytes (read into `gap_buffer` and dropped), long ones split.

    Why read gaps: a TP slice of a row-parallel weight is one short run per row (o_proj at TP 8:
    768 of every 6144 bytes). The storage reads those pages whole anyway, and one call per row
    costs more than the bytes; one call over the span, with the gaps landing in a scratch buffer,
    costs one call per chunk."""
    calls: list[tuple[str, int, list[memoryview], int]] = []
    end = size = 0
    for r in sorted(requests, key=lambda r: (r.file, r.offset)):
        for start in range(0, len(r.dest), chunk_bytes):
            piece = r.dest[start:start + chunk_bytes]
            off = r.offset + start
            gap = off - end
            if calls and calls[-1][0] == r.file and 0 <= gap <= max_gap \
                    and size + gap + len(piece) <= chunk_bytes and len(calls[-1][2]) + 2 <= IOV_MAX:
                file, first, buffers, gaps = calls[-1]
                if gap:
                    buffers.append(gap_buffer[:gap])
                buffers.append(piece)
                calls[-1] = (file, first, buffers, gaps + gap)
                size += gap + len(piece)
            else:
                calls.append((r.file, off, [piece], 0))
                size = len(piece)
            end = off + len(piece)
    return calls


class RangeReader:
    def __init__(self, files: list[str], num_threads: int, chunk_bytes: int, max_gap_bytes: int = 0,
                 on_bytes: Callable[[int], None] | None = None):
        self.fds = {f: os.open(f, os.O_RDONLY) for f in files}
        self.pool = ThreadPoolExecutor(num_threads, thread_name_prefix="beam-loader-read")
        self.chunk_bytes = chunk_bytes
        self.max_gap = max_gap_bytes
        # Gap bytes are dropped: every call may scribble on the same scratch buffer.
        self.gap_buffer = memoryview(bytearray(max_gap_bytes))
        self.on_bytes = on_bytes
        self.bytes_read = 0  # bytes that land in tensors
        self.gap_bytes = 0  # bytes read between them and dropped
        self.calls = 0
        self._lock = threading.Lock()

    def read(self, requests: list[ReadRequest]) -> None:
        """Fill every request's buffer; raises if any read fails or comes up short."""
        for _ in self.pool.map(self._read_call, _calls(requests, self.chunk_bytes, self.max_gap, self.gap_buffer)):
            pass

    def _read_call(self, call: tuple[str, int, list[memoryview], int]) -> None:
        file, offset, buffers, gaps = call
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
            self.bytes_read += want - gaps
            self.gap_bytes += gaps
            self.calls += calls
        if self.on_bytes:
            self.on_bytes(want - gaps)

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
