"""One Beam decoder layer at a time: its tensors read from the checkpoint, dequantised, put into
transformers' own `BeamDecoderLayer` modules, run on every passage, and dropped.

The modules come from a `BeamForCausalLM` built on the meta device (no memory; the same config,
attention implementation and FP8 hooks as the in-memory reference), one per dtype the streams
need. A layer's parameters are real only while it runs; an MoE layer's experts never are all at
once: they are read a group at a time (the next group read while this one computes) and each
expert is applied to the tokens routed to it only.

Arithmetic, and where it comes from:
- attention, norms, router, dense MLP, residual adds: transformers' modules and functions;
- experts of an FP8 reference stream: `beam_hpu.reference.in_memory.add_fp8_expert` (the in-memory
  reference's own per-expert function, fp32 sum over experts);
- experts of every other stream: transformers' eager `BeamExperts.forward`, called with a view
  holding one expert, on the tokens routed to it (its sum over experts kept in the model dtype).
An MoE layer is split at the experts so that each expert is read once for all passages; the two
halves are `BeamDecoderLayer.forward`'s own steps, in its order (the equality test against the
in-memory reference holds them to it).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from beam_hpu.loader.checkpoint import TensorEntry
from beam_hpu.loader.reader import RangeReader, ReadRequest, byte_view

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# Raw (FP8) bytes of experts read per group: large enough for sequential reads, small enough
# that two groups (one computing, one in flight) stay small next to the layer's working set.
EXPERT_GROUP_BYTES = 512 << 20


@dataclass(frozen=True)
class Stream:
    """One forward pass of every passage: the reference itself, or the model its top-1 floor is
    measured against (the same pair as `beam_hpu.reference.live.live_reference` loads)."""

    name: str
    dtype: torch.dtype
    fp8_max: float | None  # per-token activation rounding into quantised matmuls; None: none
    fp8_experts: bool  # experts as beam_hpu.reference.in_memory computes them; False: transformers' eager
    kv_fp8: bool = False  # K and V rounded through FP8 with the run's KV scales (beam_hpu.reference.kv_fp8)


def read_tensors(reader: RangeReader, entries: list[TensorEntry]) -> dict[str, torch.Tensor]:
    out = {e.name: torch.empty(e.shape, dtype=e.dtype) for e in entries}
    reader.read([ReadRequest(e.file, e.offset, byte_view(out[e.name])) for e in entries if e.nbytes])
    return out


def read_rows(reader: RangeReader, entry: TensorEntry, rows: list[int] | range) -> torch.Tensor:
    """Rows of a 2-D tensor, each one byte run of the file."""
    row_bytes = entry.nbytes // entry.shape[0]
    out = torch.empty((len(rows), *entry.shape[1:]), dtype=entry.dtype)
    if isinstance(rows, range) and rows.step == 1:  # one run
        reader.read([ReadRequest(entry.file, entry.offset + rows.start * row_bytes, byte_view(out))])
    else:
        reader.read([ReadRequest(entry.file, entry.offset + r * row_bytes, byte_view(out[j])) for j, r in enumerate(rows)])
    return out


def param_dtype(full_name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype transformers' `from_pretrained(dtype=...)` gives a Beam parameter: the model
    dtype, except what BeamPreTrainedModel keeps in fp32 (router weight, correction bias)."""
    from transformers.models.beam.modeling_beam import BeamPreTrainedModel

    keep = BeamPreTrainedModel._keep_in_fp32_modules_strict
    return torch.float32 if any(k in full_name for k in keep) else dtype


def layer_tensor_names(module: nn.Module, prefix: str) -> list[str]:
    """Checkpoint names of a layer's (or any module's) own tensors, experts excluded."""
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    return [f"{prefix}{n}" for n in names if not n.startswith("mlp.experts.")]


def fill(module: nn.Module, prefix: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Give `module`'s meta parameters and buffers (experts excluded) real values from `tensors`."""
    for name in layer_tensor_names(module, ""):
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        value = tensors[prefix + name].to(param_dtype(prefix + name, dtype))
        if leaf in owner._parameters:
            owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        else:
            owner._buffers[leaf] = value


def empty(module: nn.Module) -> None:
    """Back to the meta device: the layer's memory is freed, its shapes and hooks stay."""
    for name in layer_tensor_names(module, ""):
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        store = owner._parameters if leaf in owner._parameters else owner._buffers
        old = store[leaf]
        store[leaf] = (nn.Parameter(torch.empty_like(old, device="meta"), requires_grad=False)
                       if isinstance(old, nn.Parameter) else torch.empty_like(old, device="meta"))


class _OneExpert:
    """What transformers' eager `BeamExperts.forward` reads from its module, holding one expert
    (index 0; index 1 is then its 'no expert' slot, which that forward skips)."""

    num_experts = 1

    def __init__(self, experts: nn.Module, gate_up: torch.Tensor, down: torch.Tensor):
        self.act_fn = experts.act_fn
        self.gate_up_proj, self.down_proj = gate_up[None], down[None]

    def _apply_gate(self, gate_up):
        from transformers.models.beam.modeling_beam import BeamExperts

        return BeamExperts._apply_gate(self, gate_up)


@dataclass
class Routed:
    """One passage of one stream inside an MoE layer, between the router and the experts."""

    stream: Stream
    experts: nn.Module  # the stream's BeamExperts (meta weights; carries act_fn and FP8 hooks)
    x: torch.Tensor  # [T, H] experts' input
    index: torch.Tensor  # [T, k]
    weights: torch.Tensor  # [T, k]
    out: torch.Tensor  # running sum over experts: fp32 (FP8 reference) or the model dtype (eager)
    # Puts the stream's activation rounding on the (shared) modules: streams take turns on them.
    activate: Callable[[], None] = lambda: None

    def add(self, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        from transformers.models.beam.modeling_beam import BeamExperts

        from beam_hpu.reference.in_memory import add_fp8_expert

        if self.stream.fp8_experts:
            add_fp8_expert(self.experts, self.out, expert, gate_up, down, self.x, self.index, self.weights)
            return
        # transformers' eager forward visits an expert's tokens slot by slot; same order here.
        slots, tokens = torch.where((self.index == expert).T)
        eager = BeamExperts.forward.__wrapped__  # the class's own forward, not the dispatcher
        y = eager(_OneExpert(self.experts, gate_up, down), self.x[tokens],
                  torch.zeros((len(tokens), 1), dtype=self.index.dtype), self.weights[tokens, slots, None])
        self.out.index_add_(0, tokens, y)

    def result(self) -> torch.Tensor:
        return self.out.to(self.x.dtype)


def expert_groups(experts: list[int], entries_of, limit: int | None = None) -> list[list[int]]:
    limit = EXPERT_GROUP_BYTES if limit is None else limit
    groups, size = [[]], 0
    for e in experts:
        n = sum(x.nbytes for x in entries_of(e))
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += n
    return groups if groups[0] else []


def stream_experts(reader: RangeReader, experts: list[int], entries_of, weights_of, routed: list[Routed]) -> None:
    """Read the experts in groups, the next group while this one computes; apply each expert, in
    ascending order (the in-memory order), to every routed passage that uses it.
    `entries_of(e)`: its tensors on disk; `weights_of(raw, e, dtype)`: (gate_up, down) in dtype."""
    groups = expert_groups(experts, entries_of)
    with ThreadPoolExecutor(1, thread_name_prefix="beam-reference-prefetch") as pool:
        pending = pool.submit(read_tensors, reader, [x for e in groups[0] for x in entries_of(e)]) if groups else None
        for g, group in enumerate(groups):
            raw = pending.result()
            if g + 1 < len(groups):
                pending = pool.submit(read_tensors, reader, [x for e in groups[g + 1] for x in entries_of(e)])
            for e in group:
                cache = {}
                for r in routed:
                    if not bool((r.index == e).any()):
                        continue
                    if r.stream.dtype not in cache:
                        cache[r.stream.dtype] = weights_of(raw, e, r.stream.dtype)
                    r.activate()
                    r.add(e, *cache[r.stream.dtype])
            del raw
