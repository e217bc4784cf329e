"""Load a checkpoint directory into an already built model: plan, check, read, place, check."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass

import torch

from beam_hpu.loader.checkpoint import open_checkpoint
from beam_hpu.loader.options import LoaderOptions
from beam_hpu.loader.place import param_units, replay_units, run_units
from beam_hpu.loader.plan import check_complete, known_writes, plan_rank
from beam_hpu.loader.reader import RangeReader

# Under vLLM's namespace: only its loggers have handlers in the engine processes.
logger = logging.getLogger("vllm.beam_hpu.loader")


@dataclass
class LoadReport:
    label: str
    data_bytes: int  # tensor bytes read (that this rank needs)
    gap_bytes: int  # bytes read between needed ranges and dropped (see reader._calls)
    header_bytes: int  # shard header bytes read
    read_calls: int
    tensors_read: int
    tensors_total: int
    checkpoint_bytes: int
    seconds: float
    plan_seconds: float = 0.0  # headers, probe and completeness check, before the first data read

    def as_dict(self) -> dict:
        return asdict(self)


class Progress:
    """Logs "read X / Y GiB" every `step` percent of this rank's bytes (threads call `add`)."""

    def __init__(self, label: str, total: int, step_percent: int):
        self.label, self.total, self.step = label, max(total, 1), step_percent
        self.done, self.next_mark, self.t0 = 0, step_percent, time.perf_counter()
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            pct = 100 * self.done / self.total
            if pct + 1e-9 < self.next_mark:
                return
            while self.next_mark <= pct:
                self.next_mark += self.step
            dt = time.perf_counter() - self.t0
            logger.info("beam loader %s: read %.2f / %.2f GiB (%d%%), %.2f GB/s", self.label, self.done / 2**30,
                        self.total / 2**30, pct, self.done / max(dt, 1e-9) / 1e9)


def load_checkpoint(model: torch.nn.Module, directory, options: LoaderOptions | None = None,
                    label: str = "rank 0", optional: frozenset[str] = frozenset()) -> LoadReport:
    """`optional`: parameter names the checkpoint may leave out (see plan.check_complete)."""
    options = options or LoaderOptions()
    t0 = time.perf_counter()
    ckpt = open_checkpoint(directory)
    plans, params = plan_rank(model, ckpt)
    all_known = all(p.writes is not None for p in plans)
    if all_known:  # otherwise a replay must run first; checked below, still before the model is used
        check_complete(model, known_writes(plans), ckpt.directory, optional)
    needed = [p for p in plans if p.needed_runs]
    total = sum(n * p.entry.itemsize for p in needed for _, n in p.needed_runs)
    logger.info("beam loader %s: %d of %d tensors needed, %.2f of %.2f GiB, from %d shards", label, len(needed),
                len(plans), total / 2**30, ckpt.total_bytes / 2**30, len(ckpt.files))
    plan_seconds = time.perf_counter() - t0
    progress = Progress(label, total, options.progress_percent)
    replay_writes = []
    with RangeReader(ckpt.files, options.num_threads, options.chunk_bytes, options.max_gap_bytes,
                     progress.add) as reader:
        units = param_units(plans, params) + replay_units(model, plans, params, replay_writes)
        run_units(units, reader, options.max_staging_bytes)
        data_bytes, gap_bytes, calls = reader.bytes_read, reader.gap_bytes, reader.calls
    if not all_known:
        check_complete(model, known_writes(plans) + replay_writes, ckpt.directory, optional)
    report = LoadReport(label, data_bytes, gap_bytes, sum(ckpt.header_bytes.values()), calls, len(needed), len(plans),
                        ckpt.total_bytes, time.perf_counter() - t0, plan_seconds)
    logger.info("beam loader %s: loaded %d tensors, %.2f GiB (+%.2f GiB read across gaps) in %.1f s (%.2f GB/s), "
                "%d read calls", label, report.tensors_read, data_bytes / 2**30, gap_bytes / 2**30, report.seconds,
                (data_bytes + gap_bytes) / max(report.seconds, 1e-9) / 1e9, calls)
    return report
