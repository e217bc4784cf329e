"""The Gaudi verify step with sampled rows (beam_hpu.runtime.speculative.hpu_sampled_verify.verify_drafts)
has device shapes of (B, k, V) only: under HPU graphs and lazy mode a shape that followed the
step's draft counts would compile a graph per count, and a value read back would stall the step.

The step runs on the meta device (a real torch device without values): every op on a device
tensor is recorded with its inputs' and outputs' shapes and dtypes, while the host part (draft
counts, seeded uniforms, the padded layout's index) runs on the CPU unrecorded. An op that needs
a value (nonzero, a boolean-mask index, `.item()`) cannot run on meta: it is recorded before it
runs and the step's failure is reported with it. 50 steps of fixed (B, k, V) with random draft
counts 0..k, temperatures with greedy rows, seeded and unseeded requests must record one and the
same set of device ops.

One exception, by design: a seeded request with drafts has its recovery noise row drawn by its
host generator and copied into the device noise row by row (as the fix seeded-sampling does for
the bonus Sampler), so steps with such a request add exactly those [V] copies. Whether top-k /
top-p tensors exist at all is vLLM's metadata for the whole batch, so each combination is a case.
"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from beam_hpu.runtime.speculative.hpu_sampled_verify import verify_drafts
from tests.support.spec_decode import sampling_metadata

B, V = 4, 32  # K, the slots per sequence, is each test's
STEPS = 50
GREEDY = -1.0  # vllm-gaudi's temperature of a greedy request


def _signature(value):
    tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def _on_device(value) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tree_flatten(value)[0])


class DeviceOps(TorchDispatchMode):
    """(op, input signature, output signature) of every op with a device (meta) tensor among its
    inputs or outputs; an op that raised is recorded with output "raised"."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except Exception:
            if _on_device((args, kwargs)):
                self.ops.append((func, _signature((args, kwargs)), "raised"))
            raise
        if _on_device((args, kwargs, out)):  # a host-to-device copy has only its output there
            self.ops.append((func, _signature((args, kwargs)), _signature(out)))
        return out


FORBIDDEN = {torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
             torch.ops.aten._local_scalar_dense.default, torch.ops.aten.repeat_interleave.Tensor}


def forbidden(op) -> str | None:
    func, inputs, outputs = op
    if func in FORBIDDEN:
        return f"{func} (data-dependent shape or a read-back)"
    if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
                torch.ops.aten._index_put_impl_.default) and any(dtype == torch.bool for _, dtype in inputs[1:]):
        return f"{func} with a boolean mask"
    if any(dtype == torch.float64 for _, dtype in inputs + (() if outputs == "raised" else outputs)):
        return f"{func} on float64"
    if outputs == "raised":
        return f"{func} cannot run without reading values"
    return None


def gaudi_step(rng: random.Random, top_k: bool, top_p: bool, seeded: bool, K: int):
    """One verify step as vllm-gaudi lays it out (_prepare_spec_decode_inputs): sequence b's
    target rows at b*(K+1) + i, its bonus row after its drafts, padding slots' target index -1
    and draft token_ids[0]; the runner's one sampling row per sequence."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    counts = [rng.randint(0, K) for _ in range(B)]
    temperature = [GREEDY if rng.random() < 0.3 else rng.uniform(0.3, 1.5) for _ in range(B)]
    sampled = rng.randrange(B)
    temperature[sampled] = rng.uniform(0.3, 1.5)  # an all-greedy batch takes the stock verifier
    generators = {}
    if seeded:  # a seeded sampled request with drafts, and maybe more seeded requests
        counts[sampled] = max(counts[sampled], 1)
        generators = {b: torch.Generator().manual_seed(rng.randrange(1 << 30)) for b in range(B)
                      if b == sampled or rng.random() < 0.4}
    else:
        generators = {b: torch.Generator().manual_seed(1) for b in range(B) if counts[b] == 0 and rng.random() < 0.5}
    token_ids = torch.randint(0, V, (B * (K + 1),))
    target = [b * (K + 1) + i if i < counts[b] else -1 for b in range(B) for i in range(K)]
    bonus = [b * (K + 1) + counts[b] for b in range(B)]
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)
    target_indices = torch.tensor(target, dtype=torch.int32)
    metadata = SpecDecodeMetadata(
        draft_token_ids=token_ids[target_indices + 1].to("meta"), num_draft_tokens=counts,
        cu_num_draft_tokens=cu.to("meta"), cu_num_sampled_tokens=(cu + torch.arange(1, B + 1)).to("meta"),
        target_logits_indices=target_indices.to("meta"), bonus_logits_indices=torch.tensor(bonus).to("meta"),
        logits_indices=torch.arange(B * (K + 1)))
    rows = sampling_metadata([max(t, 0.0) for t in temperature], V, generators)
    rows = replace(rows, temperature=torch.tensor(temperature).to("meta"),
                   top_k=torch.tensor([rng.choice([V, 2, 5]) for _ in range(B)], dtype=torch.int32).to("meta")
                   if top_k else None,
                   top_p=torch.tensor([rng.choice([1.0, 0.9, 0.5]) for _ in range(B)]).to("meta") if top_p else None)
    logits = torch.empty(B * (K + 1), V, dtype=torch.bfloat16, device="meta")
    bonus_token_ids = torch.empty(B, 1, dtype=torch.int64, device="meta")
    return metadata, logits, rows, bonus_token_ids


def record(step, K: int) -> tuple[frozenset, list[str]]:
    """The step's set of device ops and what is forbidden among them (a step that fails to run
    on the device is reported through the op that failed)."""
    with DeviceOps() as mode:
        try:
            out = verify_drafts(*step)
        except Exception as error:  # noqa: BLE001 - the recorded op says why
            out = error
    problems = sorted({p for p in map(forbidden, mode.ops) if p})
    if isinstance(out, Exception) and not problems:
        problems = [f"the step raised {out!r}"]
    elif not isinstance(out, Exception) and (tuple(out.shape), out.dtype) != ((B, K + 1), torch.int32):
        problems.append(f"output {tuple(out.shape)} {out.dtype}")
    return frozenset((str(func), inputs, outputs) for func, inputs, outputs in mode.ops), problems


@pytest.mark.parametrize("K", [3, 7], ids=["k3", "k7 (DFlash2's block 8)"])
@pytest.mark.parametrize("top_k, top_p", [(False, False), (False, True), (True, True), (True, False)],
                         ids=["plain", "top_p", "top_k+top_p", "top_k"])
def test_device_shapes_depend_on_batch_and_slots_only(top_k, top_p, K):
    rng = random.Random(f"{top_k}{top_p}{K}")
    first: dict[bool, frozenset] = {}  # the device ops of the first step without / with seeded drafts
    counts_seen = set()
    for step_number in range(STEPS):
        seeded = step_number % 2 == 1 if step_number < 2 else rng.random() < 0.5
        step = gaudi_step(rng, top_k, top_p, seeded, K)
        counts = step[0].num_draft_tokens
        counts_seen.add(tuple(counts))
        ops, problems = record(step, K)
        assert not problems, f"step {step_number}, draft counts {counts}: {problems}"
        reference = first.setdefault(seeded, ops)
        assert ops == reference, (f"step {step_number}, draft counts {counts}: device ops of its own "
                                  f"{sorted(ops - reference, key=str)}, missing {sorted(reference - ops, key=str)}")
    assert len(counts_seen) > STEPS // 2  # the draft counts did vary
    extra = first[True] - first[False]
    assert first[False] <= first[True]
    # the seeded requests' host-drawn noise rows, copied into the [B, V] device noise
    assert {func for func, _, _ in extra} == {"aten.select.int", "aten.copy_.default"}
    assert all(shape == (V,) for _, _, outputs in extra for shape, _ in outputs)
