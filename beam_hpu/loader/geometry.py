"""Which elements of a tensor's storage a strided view touches, as sorted runs.

A weight loader narrows a checkpoint tensor (TP slice) and copies it into a view of a parameter
(an expert's rows, the q/k/v part of qkv). Both sides are strided views of a contiguous storage;
their elements, in C order, are `starts[i] + [0, length)` runs. Reading only a TP slice's bytes
means reading exactly those runs: one run for a row slice, one per row for a column slice.
"""

from __future__ import annotations

import math

import numpy as np

# Views with more runs than this (element-strided, e.g. a transposed copy) are read as their
# covering span instead: still correct, never millions of tiny reads.
MAX_RUNS = 1 << 20


def element_runs(sizes, strides, offset: int) -> tuple[np.ndarray, int]:
    """(starts, run_length) in elements, C order, for a view with no overlapping elements.

    The innermost dims that are laid out contiguously collapse into one run; the outer dims are
    enumerated. Empty views give no runs.
    """
    if any(s == 0 for s in sizes):
        return np.zeros(0, dtype=np.int64), 0
    dims = [(s, st) for s, st in zip(sizes, strides) if s != 1]
    run = 1
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    n_runs = math.prod(s for s, _ in dims)
    if n_runs > MAX_RUNS:
        lo = offset + sum((s - 1) * st for s, st in dims if st < 0)
        hi = offset + sum((s - 1) * st for s, st in zip(sizes, strides) if st > 0) + 1
        return np.array([lo], dtype=np.int64), hi - lo
    starts = np.array([offset], dtype=np.int64)
    for s, st in dims:
        starts = (starts[:, None] + np.arange(s, dtype=np.int64) * st).reshape(-1)
    return starts, run


def merged_runs(starts: np.ndarray, length: int) -> list[tuple[int, int]]:
    """Runs of equal length in C order -> [(start, length)] with adjacent runs joined.

    Order is kept (it is the order the bytes land in a contiguous destination)."""
    if len(starts) == 0:
        return []
    breaks = np.nonzero(starts[1:] != starts[:-1] + length)[0] + 1
    bounds = np.concatenate(([0], breaks, [len(starts)]))
    return [(int(starts[a]), int((b - a) * length)) for a, b in zip(bounds[:-1], bounds[1:])]


def view_runs(t) -> list[tuple[int, int]]:
    """Element runs, relative to the start of `t`'s storage, that the view `t` covers."""
    starts, length = element_runs(tuple(t.shape), tuple(t.stride()), t.storage_offset())
    return merged_runs(starts, length)


def overlaps_and_gaps(runs: list[tuple[int, int]], total: int) -> tuple[int, int]:
    """(elements written more than once, elements never written) for runs over [0, total)."""
    if not runs:
        return 0, total
    arr = np.array(sorted(runs), dtype=np.int64)
    starts, ends = arr[:, 0], arr[:, 0] + arr[:, 1]
    # Each run overlaps what the runs before it already reached.
    reach_before = np.concatenate(([starts[0]], np.maximum.accumulate(ends)[:-1]))
    overlap = int(np.clip(np.minimum(reach_before, ends) - starts, 0, None).sum())
    covered = int(arr[:, 1].sum()) - overlap
    return overlap, total - covered
