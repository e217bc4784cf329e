"""The soak's growth bound (beam_hpu/replicas/soak.py::growth_bounds) on sample series shaped like
the ones a real soak records, and `procs.usage` splitting a live process's RSS into heap, files
and shared memory as the kernel reports them."""

import os

import pytest

from beam_hpu.replicas import procs
from beam_hpu.replicas.soak import FIRST_FAULT, growth_bounds


def u(anon, fds=180, threads=78, file=600.0):
    return procs.Usage(anon + file, fds, threads, 4, anon_mib=anon, file_mib=file)


UNFAULTED = [("unfaulted", u(a)) for a in (2288, 2296, 2302, 2300)]  # spread 14, floor 2% = 46


def test_a_high_water_while_serving_alone_is_the_reference_not_a_leak():
    # A CI run's shape: +100 MiB of heap while the other replica was down, flat afterwards.
    samples = UNFAULTED + [(FIRST_FAULT, u(a)) for a in (2330, 2380, 2399)] + \
        [("faulted", u(a)) for a in (2399, 2401)] + [("end", u(2401))]
    _, last, bound = growth_bounds(samples)
    assert last.anon_mib <= bound.anon_mib
    assert bound.anon_mib == pytest.approx(2399 + 0.02 * 2302)


def test_growth_after_the_reference_is_caught():
    samples = UNFAULTED + [(FIRST_FAULT, u(2380))] + [("faulted", u(a)) for a in (2400, 2440)] + [("end", u(2430))]
    _, last, bound = growth_bounds(samples)
    assert last.anon_mib > bound.anon_mib


def test_without_a_first_fault_the_reference_is_the_unfaulted_phase():
    samples = UNFAULTED + [("faulted", u(2352))] + [("end", u(2352))]
    _, last, bound = growth_bounds(samples)
    assert bound.anon_mib == pytest.approx(2302 + 0.02 * 2302)
    assert last.anon_mib > bound.anon_mib


def test_fds_and_threads_have_their_own_floor_and_files_do_not_count():
    samples = UNFAULTED + [("end", u(2300, fds=185, threads=80, file=900))]
    _, last, bound = growth_bounds(samples)
    assert (bound.fds, bound.threads) == (184, 80)
    assert last.fds > bound.fds and last.threads <= bound.threads
    assert last.anon_mib <= bound.anon_mib  # 300 MiB more code paged in: not a leak


def test_usage_reads_the_kernels_split_of_this_process():
    mine = procs.usage(os.getpid())
    status = dict(line.split(":", 1) for line in open(f"/proc/{os.getpid()}/status").read().splitlines() if ":" in line)
    assert mine.processes >= 1 and mine.anon_mib > 0 and mine.file_mib > 0
    # The parts sum to VmRSS for each process (the kernel's definition), so for the tree too.
    assert mine.anon_mib + mine.file_mib + mine.shmem_mib == pytest.approx(mine.rss_mib, rel=0.02)
    assert "RssAnon" in status
