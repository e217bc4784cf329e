"""The Gaudi DFlash2 proposer across prefix-cache hits, on CPU, driven as vllm-gaudi's runner drives
it (tests/support/dflash2_proposers.py), with the committed tiny drafter: a request whose first
prefill row is past 0 (its first blocks cached) drafts what the same request computed from
position 0 drafts, because the proposer kept the ring rows of the blocks an earlier request wrote
(in its prefill, and in its verify steps through its accepted tokens) and hands them back. Without
the runner's block size nothing is kept, and the same request drafts otherwise: the kept rows are
what makes the difference.

The target's states are one table by position (the same tokens give the same states); rejected
verify rows carry other states, which must not be kept."""

from __future__ import annotations

import pytest
import torch

from tests.support.dflash2_proposers import Runner, hpu_prefill, hpu_proposer, hpu_verify
from tests.support.dflash2_served import tiny_dflash2

K = 3  # drafted tokens a step (verify rows 4)
N_STATES = 5
BLOCK = 16  # the runner's KV block: vLLM's prefix-cache block
PROMPT = [(7 * p) % 400 + 20 for p in range(40)]  # request a's: two full blocks and 8 tokens


@pytest.fixture(autouse=True)
def vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


@pytest.fixture
def model(vllm_config):
    return tiny_dflash2()


@pytest.fixture
def states(model):
    """Accepted states by position, and other states for rejected rows."""
    g = torch.Generator().manual_seed(5)
    width = model.model.fc.input_size
    return torch.randn(80, width, generator=g), torch.randn(80, width, generator=g)


def slot_rows(p, req_id):
    """(positions, keys, values) of a request's ring slot, in position order, empty rows dropped."""
    slot = p.slots.owner[req_id]
    positions = p.ring.positions[slot]
    order = positions.argsort()
    order = order[positions[order] >= 0]
    return positions[order], p.ring.keys[:, slot, order], p.ring.values[:, slot, order]


def prefill(p, runner, req_id, first, tokens, table, bonus):
    rows = table[first:first + len(tokens)]
    return hpu_prefill(p, runner, {req_id: (first, rows)}, {req_id: bonus}, N_STATES, T=64, bs=4,
                       ids={req_id: tokens})[0]


def test_a_prompt_on_cached_blocks_drafts_as_from_position_0(model, states):
    accepted, _ = states
    second = PROMPT[:32] + [301, 302, 303, 304, 305]
    runner = Runner(["a", "b"], prompts={"a": PROMPT, "b": second}, block_size=BLOCK)
    p = hpu_proposer(model, K)
    prefill(p, runner, "a", 0, PROMPT, accepted, 11)
    # b's first 32 tokens are a's cached blocks: the runner prefills from 32
    hit = prefill(p, runner, "b", 32, second[32:], accepted, 12)
    cold_runner = Runner(["b"], prompts={"b": second}, block_size=BLOCK)
    cold = prefill(hpu_proposer(model, K), cold_runner, "b", 0, second, accepted, 12)
    assert torch.equal(hit, cold), (hit, cold)
    # Nothing kept without the runner's block size: the same hit drafts from 5 rows only
    bare = Runner(["a", "b"], prompts={"a": PROMPT, "b": second})
    q = hpu_proposer(model, K)
    prefill(q, bare, "a", 0, PROMPT, accepted, 11)
    assert not torch.equal(prefill(q, bare, "b", 32, second[32:], accepted, 12), cold)


def test_blocks_completed_by_verify_steps_are_kept_with_their_accepted_tokens(model, states):
    accepted, rejected = states
    # a: the prompt (to 39), bonus 11 at 40; a step keeps 3 drafts (tokens 41-43, bonus 12 at 44),
    # the next 1 (token 45, bonus 13 at 46), the next 3 (47-49, bonus 14 at 50): block 2 (32-47) is whole
    steps = [(40, 3, [41, 42, 43], 12), (44, 1, [45], 13), (46, 3, [47, 48, 49], 14)]
    runner = Runner(["a", "d"], block_size=BLOCK)
    runner.requests["a"].prompt_token_ids = PROMPT
    p = hpu_proposer(model, K)
    prefill(p, runner, "a", 0, PROMPT, accepted, 11)
    for first, kept, tokens, bonus in steps:
        rows = torch.cat([accepted[first:first + 1 + kept], rejected[first + 1 + kept:first + K + 1]])
        hpu_verify(p, runner, [first], [rows], [tokens + [bonus]], N_STATES, per=K + 1)
    a_tokens = PROMPT + [11, 41, 42, 43, 12, 45, 13, 47, 48, 49]  # positions 0..49
    d_prompt = a_tokens[:48] + [201, 202, 203]
    runner.requests["d"].prompt_token_ids = d_prompt
    hit = prefill(p, runner, "d", 48, d_prompt[48:], accepted, 21)
    q = hpu_proposer(model, K)
    cold = prefill(q, Runner(["d"], prompts={"d": d_prompt}, block_size=BLOCK), "d", 0, d_prompt, accepted, 21)
    # d's slot holds the rows of positions 0..50, the first 48 taken back: a's, computed in its prefill
    # and verify layouts, against the cold run's from one prefill (fp32, apart by rounding only)
    hit_rows, cold_rows = slot_rows(p, "d"), slot_rows(q, "d")
    assert hit_rows[0].tolist() == cold_rows[0].tolist() == list(range(51))
    for got, want in zip(hit_rows[1:], cold_rows[1:]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(hit, cold), (hit, cold)
    # The kept blocks are a's three full ones, keyed by its tokens (not by a rejected row's)
    assert len(p.prefix.blocks) == 3
