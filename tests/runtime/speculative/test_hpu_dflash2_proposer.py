"""The Gaudi DFlash2 proposer (beam_hpu.runtime.speculative.hpu_dflash2_proposer) on CPU, driven
as vllm-gaudi's runner drives it (prefill batches padded with position -1, verify steps in the
padded B x (k + 1) layout, sampled token lists on the host), with the committed tiny drafter:

- its drafts equal a block drafted over every accepted row at once (the CPU proposer's context
  functions, which tests/runtime/speculative/test_cpu_dflash2_proposer.py checks against the
  whole context recomputed), through rejected drafts, padding requests, a window that wraps the
  ring, a narrower verify step, a finished request's slot taken by a new one, and more requests
  held than slots;
- the captured step records one and the same set of ops and shapes on every decode step, with
  no nonzero, read-back or boolean-mask index.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from beam_hpu.model.dflash2 import DFlash2Context
from beam_hpu.runtime.speculative import dflash2_context
from beam_hpu.runtime.speculative.hpu_dflash2_proposer import HpuDFlash2Proposer
from tests.support.dflash2_proposers import Runner, hpu_prefill, hpu_proposer, hpu_verify
from tests.support.dflash2_served import tiny_dflash2

K = 3  # drafted tokens a step (block 4)
N_STATES = 5  # target layers the drafter reads (the tiny drafter's, as the published one's)


@pytest.fixture(autouse=True)
def vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def proposer(model, **kwargs):
    return hpu_proposer(model, K, **kwargs)


def prefill(p, runner, rows, bonus, T=12, bs=4):
    return hpu_prefill(p, runner, rows, bonus, N_STATES, T, bs)


def verify(p, runner, first, states, sampled, per=K + 1, batch=4):
    return hpu_verify(p, runner, first, states, sampled, N_STATES, per, batch)


def reference(model, contexts, bonus, max_model_len=None):
    """Drafts of blocks over each request's accepted (positions, states) fed at once."""
    window = model.config.sliding_window
    kept = []
    with torch.no_grad():
        for pos, states in contexts:
            k, v = model.context_kv(model.combine_hidden_states(states), pos)
            kept.append(dflash2_context.extend(None, pos, k, v, window))
        keys, values, ctx_pos, valid = dflash2_context.batch(kept)
        last = torch.tensor([c.last_position for c in kept])
        ids, block_pos, in_range = dflash2_context.block_inputs(
            torch.tensor(bonus), last, K + 1, model.mask_token_id, max_model_len or model.config.max_position_embeddings)
        hidden = model(ids, block_pos, DFlash2Context(keys, values, ctx_pos, valid, in_range))
        return model.draft_greedy(hidden, ids[:, 0])[0]


@pytest.mark.parametrize("window", [4096, 6])
def test_drafts_equal_blocks_over_the_accepted_context_fed_at_once(window):
    """a prefills 9 tokens, b 5 (one batch padded to 4 x 12); a verify step accepts 1 of a's 3
    drafts (two rejected rows of garbage) and all of b's; a narrower step (2 rows each: the grammar
    trimmed the drafts) accepts a's one and none of b's; a plain decode step follows (no drafts
    scheduled: no spec-decode metadata). With a window of 6 the ring wraps."""
    model = tiny_dflash2(sliding_window=window)
    width = model.model.fc.input_size
    g = torch.Generator().manual_seed(0)
    full = {"a": torch.randn(14, width, generator=g), "b": torch.randn(11, width, generator=g)}
    garbage = torch.full((2, width), 1e4)
    runner = Runner(["a", "b"])
    p = proposer(model)
    with torch.no_grad():
        drafts = prefill(p, runner, {"a": (0, full["a"][:9]), "b": (0, full["b"][:5])}, {"a": 3, "b": 4})
        assert torch.equal(drafts, reference(model, [(torch.arange(9), full["a"][:9]),
                                                      (torch.arange(5), full["b"][:5])], [3, 4]))
        # verify: a's rows 9..12 (accepts 1: rows 9, 10), b's rows 5..8 (accepts 3: rows 5..8)
        drafts = verify(p, runner, [9, 5], [torch.cat([full["a"][9:11], garbage]), full["b"][5:9]],
                        [[7, 21], [8, 8, 8, 22]])
        assert torch.equal(drafts, reference(model, [(torch.arange(11), full["a"][:11]),
                                                      (torch.arange(9), full["b"][:9])], [21, 22]))
        # a narrower step: a's rows 11, 12 (accepts 1), b's rows 9, 10 (accepts 0)
        drafts = verify(p, runner, [11, 9], [full["a"][11:13], torch.cat([full["b"][9:10], garbage[:1]])],
                        [[5, 23], [24]], per=2)
        assert torch.equal(drafts, reference(model, [(torch.arange(13), full["a"][:13]),
                                                      (torch.arange(10), full["b"][:10])], [23, 24]))
        # a plain decode step (no request carried drafts): one row each
        drafts = verify(p, runner, [13, 10], [full["a"][13:14], full["b"][10:11]], [[25], [26]], per=1)
        assert torch.equal(drafts, reference(model, [(torch.arange(14), full["a"]),
                                                      (torch.arange(11), full["b"])], [25, 26]))


def test_a_finished_requests_slot_holds_nothing_for_the_next():
    """a held the only slot (positions 0..10); c takes it after a prefix-cache hit on 8 tokens, so
    its first rows are 8..11: the ring rows of positions 0..7 still hold a's keys, at positions
    below c's last, and c's block must not see them."""
    model = tiny_dflash2()
    width = model.model.fc.input_size
    g = torch.Generator().manual_seed(1)
    a, c = torch.randn(11, width, generator=g), torch.randn(4, width, generator=g)
    p = proposer(model, max_num_seqs=1)
    with torch.no_grad():
        prefill(p, Runner(["a"]), {"a": (0, a)}, {"a": 3})
        drafts = prefill(p, Runner(["c"]), {"c": (8, c)}, {"c": 9})
        assert torch.equal(drafts, reference(model, [(torch.arange(8, 12), c)], [9]))


def test_more_requests_than_slots_take_the_least_recently_used_idle_slot():
    """The runner keeps preempted requests beside running ones, so it can hold more than
    max_num_seqs: a new request takes the slot of the one that drafted least recently outside its
    step, and that one starts over when it comes back."""
    model = tiny_dflash2()
    width = model.model.fc.input_size
    g = torch.Generator().manual_seed(4)
    rows = {r: torch.randn(5, width, generator=g) for r in "abc"}
    p = proposer(model, max_num_seqs=2)
    everyone = Runner(["a", "b", "c"])  # all three held by the runner, two run at a time
    with torch.no_grad():
        prefill(p, everyone, {"a": (0, rows["a"])}, {"a": 1})
        prefill(p, everyone, {"b": (0, rows["b"])}, {"b": 2})
        prefill(p, everyone, {"c": (0, rows["c"])}, {"c": 3})  # takes a's slot
        assert set(p.slots.owner) == {"b", "c"}
        drafts = prefill(p, everyone, {"a": (5, rows["a"][:1])}, {"a": 4})  # a is back: only its new row
        assert torch.equal(drafts, reference(model, [(torch.tensor([5]), rows["a"][:1])], [4]))
        assert set(p.slots.owner) == {"c", "a"}
        with pytest.raises(RuntimeError, match="3 requests in one drafting step, more than the 2 context slots"):
            prefill(p, everyone, {r: (10, rows[r]) for r in "abc"}, {r: 5 for r in "abc"})


def test_a_block_past_max_model_len_drafts_what_the_rows_below_it_can():
    model = tiny_dflash2()
    width = model.model.fc.input_size
    mml = 11  # a's last accepted position after prefill is 9: the block's rows sit at 10 .. 13
    a = torch.randn(10, width, generator=torch.Generator().manual_seed(2))
    p = proposer(model, max_model_len=mml)
    with torch.no_grad():
        drafts = prefill(p, Runner(["a"]), {"a": (0, a)}, {"a": 3})
    assert torch.equal(drafts, reference(model, [(torch.arange(10), a)], [3], max_model_len=mml))


class StepOps(TorchDispatchMode):
    """(op, shapes and dtypes of its tensors) of every op while `recording` is set."""

    def __init__(self):
        super().__init__()
        self.recording, self.ops = False, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.recording:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            # a boolean tensor as an index: a shape that follows the mask's count
            masks = "index" in str(func) and any(isinstance(t, torch.Tensor) and t.dtype == torch.bool
                                                 for t in tree_flatten(args[1:])[0])
            self.ops.add((str(func), tuple((tuple(t.shape), t.dtype) for t in tensors), masks))
        return out


def test_every_decode_step_runs_the_same_device_ops():
    """20 verify steps of a padded batch of 4 with 1..3 live sequences, random accepted counts and
    some narrower steps and plain decode steps: the captured step records the same ops and shapes
    each time (narrower layouts are padded to k + 1 rows before it)."""
    model = tiny_dflash2()
    width = model.model.fc.input_size
    rng = random.Random(0)
    g = torch.Generator().manual_seed(3)
    p = proposer(model)
    names = ["a", "b", "c"]
    length = {r: 6 for r in names}
    with torch.no_grad():
        prefill(p, Runner(names), {r: (0, torch.randn(6, width, generator=g)) for r in names}, {r: 1 for r in names})
        seen = []
        for _ in range(20):
            live = names[:rng.randint(1, 3)]
            per = rng.choice([K + 1, K + 1, 2, 1])  # 1: a plain decode step
            accepted = [rng.randint(1, per) for _ in live]
            recorder = StepOps()
            hooks = [p.step.register_forward_pre_hook(lambda *_: setattr(recorder, "recording", True)),
                     p.step.register_forward_hook(lambda *_: setattr(recorder, "recording", False))]
            with recorder:
                verify(p, Runner(live), [length[r] for r in live], [torch.randn(per, width, generator=g) for _ in live],
                       [[5] * n for n in accepted], per=per)
            for h in hooks:
                h.remove()
            for r, n in zip(live, accepted):
                length[r] += n
            seen.append(recorder.ops)
    assert seen[0] and all(ops == seen[0] for ops in seen)
    names_seen = {op for op, _, _ in seen[0]}
    assert not any("nonzero" in op or "_local_scalar_dense" in op or "masked_select" in op for op in names_seen)
    assert not any(masks for _, _, masks in seen[0])


def test_a_drafter_config_without_a_window_is_refused_naming_the_field():
    from beam_hpu.model.dflash2 import DFlash2ConfigError

    model = tiny_dflash2(sliding_window=None)
    with pytest.raises(DFlash2ConfigError, match="config.sliding_window is missing"):
        proposer(model)


def test_a_top_level_mask_token_drafts_as_one_in_dflash_config_and_none_is_refused_naming_the_file(tmp_path):
    """The proposer takes the mask token where the model does (dflash_config, else the config's top
    level); a config with neither stops it before the drafter loads, naming both fields and the file."""
    from beam_hpu.model.dflash2 import DFlash2ConfigError

    model = tiny_dflash2()
    dflash = {k: v for k, v in model.config.dflash_config.items() if k != "mask_token_id"}
    moved = tiny_dflash2(dflash_config=dflash, mask_token_id=model.mask_token_id)
    assert moved.mask_token_id == model.mask_token_id
    width = model.model.fc.input_size
    states = torch.randn(7, width, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        drafts = [prefill(proposer(m), Runner(["a"]), {"a": (0, states)}, {"a": 9}) for m in (model, moved)]
    assert torch.equal(drafts[0], drafts[1])
    neither = SimpleNamespace(**{k: v for k, v in vars(moved.config).items() if k != "mask_token_id"})
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=K, draft_model_config=SimpleNamespace(
            hf_config=neither, model=str(tmp_path))),
        model_config=SimpleNamespace(max_model_len=64), scheduler_config=SimpleNamespace(max_num_seqs=2))
    with pytest.raises(DFlash2ConfigError) as e:
        HpuDFlash2Proposer(config, "cpu")
    assert "dflash_config.mask_token_id" in str(e.value) and f"{tmp_path}/config.json" in str(e.value)
