"""Turn probe plans into reads, and land the bytes in the parameters.

A *unit* is what is handed over at once: one parameter (all its checkpoint slices: a rank's
whole expert stack, the q, k and v parts of qkv), or one replayed tensor. A parameter on the CPU
is read into directly. A parameter elsewhere (HPU) gets a host staging tensor of its shape, all of
its slices are read into that, and it is copied to the device in one transfer. Units run in
batches whose staging memory stays under the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from beam_hpu.loader.checkpoint import TensorEntry
from beam_hpu.loader.param_index import ParamIndex, ParamView, Write
from beam_hpu.loader.probe import TensorPlan
from beam_hpu.loader.reader import RangeReader, ReadRequest, byte_view
from beam_hpu.loader.record import record_writes


@dataclass
class Unit:
    staged_bytes: int = 0
    requests: list[ReadRequest] = field(default_factory=list)
    finish: list[Callable[[], None]] = field(default_factory=list)
    first_offset: tuple[str, int] = ("", 0)


def needs_staging(param: torch.Tensor) -> bool:
    return param.device.type != "cpu"


def _requests(entry: TensorEntry, runs, dest: torch.Tensor, packed: bool) -> list[ReadRequest]:
    """Reads of `runs` (elements of `entry`) into contiguous `dest`: back to back when `packed`
    (dest is the slice itself), else at each run's own element offset (dest is the full tensor)."""
    mv, size, pos, out = byte_view(dest), entry.itemsize, 0, []
    for start, n in runs:
        at = pos if packed else start * size
        out.append(ReadRequest(entry.file, entry.offset + start * size, mv[at:at + n * size]))
        pos += n * size
    return out


def param_units(plans: list[TensorPlan], params: ParamIndex) -> list[Unit]:
    by_param: dict[str, Unit] = {}
    staging: dict[str, torch.Tensor] = {}
    for plan in plans:
        for p in plan.placements:
            unit = by_param.setdefault(p.param, Unit(first_offset=(plan.entry.file, plan.entry.offset)))
            # A destination that is no parameter is staged as a whole tensor of its own.
            where = params.find(p.dst) or ParamView(p.param, p.dst, torch.empty(p.dst.shape, device="meta"))
            param, target = where.param, p.dst
            if needs_staging(param):
                if p.param not in staging:
                    staging[p.param] = torch.empty(param.shape, dtype=param.dtype, device="cpu")
                    unit.staged_bytes += param.numel() * param.element_size()
                    unit.finish.append(lambda d=param, s=staging[p.param]: d.copy_(s))
                # The slot's place in the parameter, from the chain of views that made it.
                layout = where.layout
                target = staging[p.param].as_strided(layout.shape, layout.stride(), layout.storage_offset())
            if target.is_contiguous() and target.dtype == plan.entry.dtype and tuple(target.shape) == p.src_shape:
                unit.requests += _requests(plan.entry, p.src_runs, target, packed=True)
            else:  # a dtype cast or a strided slot: read the slice, then let torch copy it in
                temp = torch.empty(p.src_shape, dtype=plan.entry.dtype)
                unit.staged_bytes += temp.numel() * temp.element_size()
                unit.requests += _requests(plan.entry, p.src_runs, temp, packed=True)
                # Run before the staging copy (inserted first): the slot must be filled first.
                unit.finish.insert(0, lambda t=target, s=temp: t.copy_(s))
    return list(by_param.values())


def replay_units(model: torch.nn.Module, plans: list[TensorPlan], params: ParamIndex,
                 replay_writes: list[Write]) -> list[Unit]:
    units = []
    for plan in plans:
        if plan.replay_runs is None or not plan.replay_runs:
            continue
        e = plan.entry
        full = torch.zeros(e.shape, dtype=e.dtype)  # only the needed runs are read; the loader reads no other
        unit = Unit(staged_bytes=e.nbytes, first_offset=(e.file, e.offset),
                    requests=_requests(e, plan.replay_runs, full, packed=False))

        def finish(name=e.name, full=full, plan=plan):
            if plan.writes is None:  # the probe could not see where: record it now
                replay_writes.extend(record_writes(model, params, name, full))
            else:
                model.load_weights([(name, full)])

        unit.finish.append(finish)
        units.append(unit)
    return units


def run_units(units: list[Unit], reader: RangeReader, max_staging_bytes: int) -> None:
    """Read and finish units in file order, in batches that stay within the staging budget."""
    batch: list[Unit] = []
    staged = 0
    for unit in sorted(units, key=lambda u: u.first_offset):
        if batch and staged + unit.staged_bytes > max_staging_bytes:
            _run_batch(batch, reader)
            batch, staged = [], 0
        batch.append(unit)
        staged += unit.staged_bytes
    if batch:
        _run_batch(batch, reader)


def _run_batch(batch: list[Unit], reader: RangeReader) -> None:
    reader.read([r for u in batch for r in u.requests])
    for u in batch:
        for f in u.finish:
            f()
