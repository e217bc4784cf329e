"""The DFlash2 drafter's context across prefix-cache hits (beam_hpu.runtime.speculative.dflash2_prefix)
in the CPU proposer, without an engine: a request whose first blocks were a cache hit drafts as a
request fed every row from position 0 (what a cold request computes), and without the kept rows it
would not."""

from __future__ import annotations

import pytest
import torch

from beam_hpu.runtime.speculative.dflash2_context import RequestContext
from beam_hpu.runtime.speculative.dflash2_prefix import PrefixContexts, block_keys
from tests.support.dflash2_proposers import admit, cpu_propose, cpu_proposer
from tests.support.dflash2_served import tiny_dflash2

BS, K = 4, 3


@pytest.fixture(autouse=True)
def vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def test_block_keys_chain_every_token_before_the_blocks_end():
    a = block_keys(list(range(10)), BS)
    assert len(a) == 2  # two full blocks of 4; the last 2 tokens are no block
    assert block_keys(list(range(8)) + [99, 98], BS) == a
    assert block_keys([7] + list(range(1, 10)), BS)[1] != a[1]  # a change in block 0 changes block 1's key
    assert block_keys(list(range(12)), BS, known=a) == block_keys(list(range(12)), BS)


def _ctx(first, n):
    pos = torch.arange(first, first + n)
    rows = pos.float().view(1, n, 1, 1).expand(2, n, 1, 3).clone()
    return RequestContext(pos, rows, -rows)


def test_kept_rows_come_back_for_the_blocks_before_a_later_start_within_the_window():
    store, keys = PrefixContexts(BS, 100), block_keys(list(range(40)), BS)
    store.keep(keys, _ctx(2, 18))  # positions 2..19: blocks 1..4 whole, block 0 not
    assert len(store.blocks) == 4
    got = store.restore(keys, 14, window=None)  # a request starting at 14: blocks 1..3, cut at 13
    assert got.positions.tolist() == list(range(4, 14))
    assert got.keys[0, :, 0, 0].tolist() == list(range(4, 14)) and got.values[1, :, 0, 2].tolist() == [-p for p in range(4, 14)]
    assert store.restore(keys, 14, window=5).positions.tolist() == list(range(8, 14))  # block 2 holds 13 - 5 + 1
    assert store.restore(keys, 3, window=None) is None  # block 0 was never whole here
    assert store.restore(block_keys([5] * 40, BS), 14, window=None) is None  # other tokens: other keys


def test_a_block_with_a_hole_is_not_kept_and_the_oldest_go_first():
    store, keys = PrefixContexts(BS, 2), block_keys(list(range(40)), BS)
    holed = _ctx(0, 12)
    holed = RequestContext(torch.cat([holed.positions[:5], holed.positions[6:]]), holed.keys[:, [*range(5), *range(6, 12)]],
                           holed.values[:, [*range(5), *range(6, 12)]])
    store.keep(keys, holed)
    assert keys[1] not in store.blocks
    store.keep(keys, _ctx(0, 16))
    assert list(store.blocks) == [keys[2], keys[3]]  # bounded at 2: blocks 0 and 1 left first


def _states(width, n, seed):
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("window", [4096, 12])
def test_a_cache_hit_drafts_as_a_request_that_computed_its_prefix(window):
    """a's prompt (20 tokens) is computed whole. b's prompt shares its first 16 (four blocks, a
    cache hit: vLLM hands the drafter only b's rows 16..23) and the target's states there are a's.
    b's block hidden states and drafts equal a cold proposer's fed all of b's rows from 0; a
    proposer that keeps no block rows drafts b from rows 16..23 alone, and differs."""
    model = tiny_dflash2(sliding_window=window)
    width = model.model.fc.input_size
    a_tokens, b_tokens = list(range(100, 120)), list(range(100, 116)) + list(range(300, 308))
    a_states = _states(width, 20, 1)
    b_states = torch.cat([a_states[:16], _states(width, 8, 2)])
    hidden = {}

    def run(name, proposer, rows):
        seen = []
        hook = model.register_forward_hook(lambda m, i, out: seen.append(out.clone()))
        with torch.no_grad():
            drafts = cpu_propose(proposer, K, [len(rows)], torch.tensor(rows), b_states[rows], torch.tensor([7]),
                                 token_ids=torch.tensor([b_tokens[r] for r in rows]))
        hook.remove()
        hidden[name] = seen[-1]
        return drafts

    warm = cpu_proposer(model, ["a"], window=window, block_size=BS, prompts={"a": a_tokens})
    with torch.no_grad():
        cpu_propose(warm, K, [20], torch.arange(20), a_states, torch.tensor([5]), token_ids=torch.tensor(a_tokens))
    warm.runner.input_batch.req_ids = ["b"]
    admit(warm, "b", b_tokens)
    hit = run("hit", warm, list(range(16, 24)))
    cold = run("cold", cpu_proposer(model, ["b"], window=window, block_size=BS, prompts={"b": b_tokens}), list(range(24)))
    forgot = run("without kept rows", cpu_proposer(model, ["b"], window=window, prompts={"b": b_tokens}),
                 list(range(16, 24)))
    assert torch.equal(hit, cold)
    torch.testing.assert_close(hidden["hit"], hidden["cold"], rtol=1e-5, atol=1e-5)
    assert (hidden["without kept rows"] - hidden["cold"]).abs().max() > 1e-2
    assert warm.contexts["b"].positions[0] == (0 if window > 24 else 24 - window + 1)
