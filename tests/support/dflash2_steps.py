"""Three drafting steps of two requests, the same accepted rows handed to either DFlash2 proposer
(tests/support/dflash2_proposers.py): a prefill, then two verify steps with rejected drafts.

Request a starts at position 0. Request b sits at the top of the model length (its prompt's start
a prefix-cache hit): its blocks reach past max_model_len and are clamped there, and the scheduler
gives it only the drafts that fit. Rows a step rejects carry the target's states at the rejected
drafts (other random rows), which neither proposer may keep as context.
"""

from __future__ import annotations

import torch

# first position and rows of each request's prefill; bonus tokens of each step
PREFILL = {"a": (0, 9), "b": (4080, 10)}
# (first position, rows = 1 + drafts scheduled, drafts accepted) of each request in a verify step
VERIFY = [{"a": (9, 8, 2), "b": (4090, 6, 3)},  # b's last accepted 4093: 6 of its 8 block rows clamped
          {"a": (12, 8, 0), "b": (4094, 2, 0)}]
BONUS = [{"a": 3, "b": 4}, {"a": 21, "b": 22}, {"a": 23, "b": 24}]


def step_case(width: int, max_model_len: int, seed: int = 0) -> dict:
    """float32 tables of the target's states by position: `accepted` (what a row carries when its
    token is kept) and `rejected` (what it carries at a rejected draft), per request."""
    assert max(first + rows for step in VERIFY for first, rows, _ in step.values()) <= max_model_len
    g = torch.Generator().manual_seed(seed)
    top = {r: max(first + rows for first, rows, _ in (s[r] for s in VERIFY)) for r in PREFILL}
    return {kind: {r: (PREFILL[r][0], torch.randn(top[r] - PREFILL[r][0], width, generator=g)) for r in PREFILL}
            for kind in ("accepted", "rejected")}


def _rows(case, dtype, rid, first, rows, accepted):
    """[rows, width] states of one request's step rows: the first 1 + accepted kept, the rest rejected."""
    start, table = case["accepted"][rid]
    _, garbage = case["rejected"][rid]
    kept = 1 + accepted
    return torch.cat([table[first - start:first - start + kept],
                      garbage[first - start + kept:first - start + rows]]).to(dtype)


def _dtype(model) -> torch.dtype:
    return model.model.norm.weight.dtype  # not a linear's: vLLM-CPU's post-load step may change those


def hpu_steps(model, case: dict, k: int) -> dict:
    """Drafts [2, k] of each step from HpuDFlash2Proposer and the block's hidden states [2, k + 1, H]."""
    from tests.support.dflash2_proposers import Runner, hpu_prefill, hpu_proposer, hpu_verify

    n_states = len(model.config.dflash_config["target_layer_ids"])
    blocks = []
    hook = model.register_forward_hook(lambda m, i, out: blocks.append(out[:len(PREFILL)].clone()))
    p, runner, dtype = hpu_proposer(model, k), Runner(list(PREFILL)), _dtype(model)
    drafts = [hpu_prefill(p, runner, {r: (first, _rows(case, dtype, r, first, n, n - 1))
                                      for r, (first, n) in PREFILL.items()}, BONUS[0], n_states)]
    for step, bonus in zip(VERIFY, BONUS[1:]):
        states = [_rows(case, dtype, r, *step[r]) for r in PREFILL]
        sampled = [[5] * step[r][2] + [bonus[r]] for r in PREFILL]
        drafts.append(hpu_verify(p, runner, [step[r][0] for r in PREFILL], states, sampled, n_states, per=k + 1))
    hook.remove()
    return {"drafts": drafts, "hidden": blocks, "margins": walk_margins(model, blocks)}


def cpu_steps(model, case: dict, k: int) -> dict:
    """The same from CpuDFlash2Proposer."""
    from tests.support.dflash2_proposers import cpu_propose, cpu_proposer

    blocks = []
    hook = model.register_forward_hook(lambda m, i, out: blocks.append(out.clone()))
    p, dtype = cpu_proposer(model, list(PREFILL)), _dtype(model)

    def run(spans, bonus, rejected=None):
        positions = torch.cat([torch.arange(first, first + n) for first, n, _ in spans.values()])
        states = torch.cat([_rows(case, dtype, r, first, n, a) for r, (first, n, a) in spans.items()])
        return cpu_propose(p, k, [n for _, n, _ in spans.values()], positions, states,
                           torch.tensor([bonus[r] for r in spans]), rejected)

    drafts = [run({r: (first, n, n - 1) for r, (first, n) in PREFILL.items()}, BONUS[0])]
    for step, bonus in zip(VERIFY, BONUS[1:]):
        drafts.append(run(step, bonus, [n - 1 - a for _, n, a in step.values()]))
    hook.remove()
    return {"drafts": drafts, "hidden": blocks, "margins": walk_margins(model, blocks)}


def walk_margins(model, blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each step's [2, k] gaps between the score of the candidate the greedy walk took and the
    runner-up's on the row it read: how far a drafted token is from a tie."""
    margins = []
    for hidden, bonus in zip(blocks, BONUS):
        _, rows, _ = model.draft_greedy(hidden, torch.tensor([bonus[r] for r in PREFILL]))
        top = rows.float().topk(2, dim=-1).values
        margins.append(top[..., 0] - top[..., 1])
    return margins


def layer_calls(model) -> dict[str, int]:
    """Calls of each CustomOp layer of `model` from now on, by `module.Class.dispatched_method`:
    which class vLLM built and which of its forwards its dispatch picked."""
    calls: dict[str, int] = {}
    for module in model.modules():
        method = getattr(module, "_forward_method", None)
        if method is None:
            continue
        name = f"{type(module).__module__}.{type(module).__name__}.{method.__name__}"
        calls.setdefault(name, 0)
        module.register_forward_hook(lambda m, i, o, name=name: calls.__setitem__(name, calls[name] + 1))
    return calls
