"""The CPU DFlash2 proposer (beam_hpu.runtime.speculative.cpu_dflash2_proposer) without an engine:
its per-request context against the whole context recomputed, the candidate walk against its rule
stated over token ids, and what the runtime patch hands which runner."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from beam_hpu.model.dflash2 import DFlash2Context
from beam_hpu.runtime.speculative import dflash2_context
from tests.support.dflash2_proposers import cpu_proposer, cpu_propose
from tests.support.dflash2_served import tiny_dflash2

L, NKV, D = 2, 2, 4


@pytest.fixture(autouse=True)
def vllm_config():
    # vLLM's layers ask for the current config when built and run.
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def _rows(positions):
    n = len(positions)
    pos = torch.tensor(positions)
    return pos, pos.float().view(1, n, 1, 1).expand(L, n, NKV, D).clone(), -pos.float().view(1, n, 1, 1).expand(L, n, NKV, D).clone()


def test_context_rewinds_to_the_first_new_position_and_keeps_what_the_window_shows():
    ctx = dflash2_context.extend(None, *_rows([0, 1, 2, 3, 4]), window=None)
    ctx = dflash2_context.extend(ctx, *_rows([3, 4, 5]), window=None)  # recomputed from 3 (preempted)
    assert ctx.positions.tolist() == [0, 1, 2, 3, 4, 5]
    assert ctx.keys[0, :, 0, 0].tolist() == [0, 1, 2, 3, 4, 5]
    # The next block starts at 9 and sees j when 9 - j < 4: 6, 7, 8.
    ctx = dflash2_context.extend(ctx, *_rows([6, 7, 8]), window=4)
    assert ctx.positions.tolist() == [6, 7, 8]
    assert ctx.values[1, :, 1, 3].tolist() == [-6, -7, -8]


def test_batch_pads_and_marks_padding_invalid():
    a = dflash2_context.extend(None, *_rows([0, 1, 2]), window=None)
    b = dflash2_context.extend(None, *_rows([4]), window=None)
    keys, values, positions, valid = dflash2_context.batch([a, b])
    assert keys.shape == (L, 2, 3, NKV, D) and values.shape == keys.shape
    assert positions.tolist() == [[0, 1, 2], [4, 0, 0]]
    assert valid.tolist() == [[True, True, True], [True, False, False]]
    ids, pos, in_range = dflash2_context.block_inputs(torch.tensor([7, 9]), torch.tensor([2, 4]), 4, 511, 100)
    assert ids.tolist() == [[7, 511, 511, 511], [9, 511, 511, 511]]
    assert pos.tolist() == [[3, 4, 5, 6], [5, 6, 7, 8]]
    assert in_range.all()


def test_block_rows_past_the_model_length_take_no_part():
    """A block that reaches past max_model_len: its rows there sit at max_model_len - 1 (inside
    the RoPE table) and are no keys, so the rows below draft what a block cut at max_model_len
    drafts (the convolution's taps look back only); unclamped, vLLM's native RoPE raises."""
    model = tiny_dflash2()
    mml = model.config.max_position_embeddings  # the model length at the RoPE table's end
    g = torch.Generator().manual_seed(1)
    width = model.model.fc.input_size
    ctx_pos = torch.arange(mml - 40, mml - 3)[None]
    with torch.no_grad():
        keys, values = model.context_kv(model.combine_hidden_states(torch.randn(37, width, generator=g)), ctx_pos[0])
        context = lambda rows=None: DFlash2Context(keys[:, None], values[:, None], ctx_pos,  # noqa: E731
                                                   torch.ones_like(ctx_pos, dtype=torch.bool), rows)
        ids, pos, in_range = dflash2_context.block_inputs(torch.tensor([5]), ctx_pos[:, -1], 8, model.mask_token_id, mml)
        assert pos.tolist() == [[mml - 3, mml - 2] + [mml - 1] * 6]
        assert in_range.tolist() == [[True] * 3 + [False] * 5]
        cut = model(ids[:, :3], pos[:, :3], context())
        with pytest.raises(IndexError):  # unclamped: past the RoPE table
            model(ids, ctx_pos[:, -1:] + torch.arange(1, 9)[None], context())
        whole = model(ids, pos, context(in_range))
    torch.testing.assert_close(whole[:, :3], cut, rtol=1e-5, atol=1e-5)


def test_the_walk_follows_its_rule_over_token_ids():
    """Drafted token t = the candidate c (top-k of row t + 1's soft-capped logits) with the largest
    logit(c) + <A[d(t-1)] * P h(t+1), B[c]>, d(-1) the bonus token: written per request with loops."""
    model = tiny_dflash2()
    sel = model.model.candidate_selector
    sel.predecessor_codebook.data *= 6  # edges large enough to overrule the logits somewhere
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 5, model.config.hidden_size, generator=g)
    anchors = torch.tensor([5, 17, 300])
    with torch.no_grad():
        drafts, _, _ = model.draft_greedy(hidden, anchors)
        logits = model.compute_logits(hidden[:, 1:])
        proj = sel.hidden_projection(hidden[:, 1:])
    overruled = False
    for r in range(3):
        previous = int(anchors[r])
        for t in range(4):
            candidates = logits[r, t].topk(sel.top_k).indices.tolist()
            score = {c: float(logits[r, t, c]) + float((sel.predecessor_codebook[previous] * proj[r, t]
                                                        * sel.successor_codebook[c]).sum()) for c in candidates}
            best = max(score, key=score.get)
            assert int(drafts[r, t]) == best, (r, t)
            overruled |= best != candidates[0]
            previous = best
    assert overruled


def _proposer(model, window):
    p = cpu_proposer(model, ["a", "b"], window=window)
    seen = []
    model.register_forward_hook(lambda m, i, out: seen.append(out.clone()))
    return p, seen


def _propose(p, lengths, positions, states, bonus, rejected=None):
    return cpu_propose(p, 3, lengths, positions, states, bonus, rejected)


@pytest.mark.parametrize("window", [4096, 4])
def test_a_verify_step_drafts_as_if_the_accepted_context_were_fed_at_once(window):
    """Step 1 prefills 9 and 5 tokens; step 2 verifies 3 drafts each (a accepts 1: its last two rows
    are rejected and hold garbage; b accepts all). The second block, its hidden states and drafts,
    equals a fresh proposer's fed every accepted row at once; with a window of 4 the kept context
    is what the drafter's attention would let the block see."""
    model = tiny_dflash2(sliding_window=window)
    width = model.model.fc.input_size
    g = torch.Generator().manual_seed(0)
    full = {"a": torch.randn(11, width, generator=g), "b": torch.randn(9, width, generator=g)}
    with torch.no_grad():
        p, seen = _proposer(model, window)
        _propose(p, [9, 5], torch.cat([torch.arange(9), torch.arange(5)]),
                 torch.cat([full["a"][:9], full["b"][:5]]), torch.tensor([3, 4]))
        garbage = torch.full((2, width), 1e4)
        step2 = torch.cat([full["a"][9:11], garbage, full["b"][5:9]])
        drafts = _propose(p, [4, 4], torch.cat([torch.arange(9, 13), torch.arange(5, 9)]), step2,
                          torch.tensor([21, 22]), rejected=[2, 0])
        fresh, fresh_seen = _proposer(model, window)
        expected = _propose(fresh, [11, 9], torch.cat([torch.arange(11), torch.arange(9)]),
                            torch.cat([full["a"], full["b"]]), torch.tensor([21, 22]))
    assert drafts.shape == (2, 3)
    assert torch.equal(drafts, expected)
    torch.testing.assert_close(seen[-1], fresh_seen[-1], rtol=1e-5, atol=1e-5)
    assert p.contexts["a"].last_position == 10 and p.contexts["b"].last_position == 8
    assert p.contexts["a"].positions.shape[0] == (11 if window > 11 else window - 1)


def test_finished_requests_leave_the_store():
    model = tiny_dflash2()
    with torch.no_grad():
        p, _ = _proposer(model, 4096)
        _propose(p, [2, 2], torch.tensor([0, 1, 0, 1]), torch.randn(4, model.model.fc.input_size),
                 torch.tensor([1, 2]))
        assert set(p.contexts) == {"a", "b"}
        p.runner.requests = {"a": 0}
        p.runner.input_batch.req_ids = ["a"]
        _propose(p, [1], torch.tensor([2]), torch.randn(1, model.model.fc.input_size), torch.tensor([1]))
    assert set(p.contexts) == {"a"}


def test_only_a_beam_target_with_a_dflash2_beam_drafter_gets_the_proposer():
    from beam_hpu.scope import serves_beam_dflash2

    def config(model_type, method, arch):
        spec = SimpleNamespace(method=method, draft_model_config=SimpleNamespace(architectures=[arch]))
        return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type)),
                               speculative_config=spec)

    assert serves_beam_dflash2(config("beam", "dflash", "DFlash2BeamDraftModel"))
    assert not serves_beam_dflash2(config("qwen3", "dflash", "DFlash2BeamDraftModel"))
    assert not serves_beam_dflash2(config("beam", "dflash", "DFlashDraftModel"))
    assert not serves_beam_dflash2(config("beam", "eagle3", "DFlash2BeamDraftModel"))
    assert not serves_beam_dflash2(SimpleNamespace(model_config=None, speculative_config=None))


def test_a_config_without_a_mask_token_is_refused_before_vllms_own_lookup(tmp_path):
    """The proposer resolves the mask token (beam_hpu.model.dflash2.mask_token_id, the model's
    function) first: a config with neither field is refused naming both and the file, not by
    vLLM's parallel-drafting lookup, which names no file."""
    from beam_hpu.model.dflash2 import DFlash2ConfigError
    from beam_hpu.runtime.speculative.cpu_dflash2_proposer import CpuDFlash2Proposer

    config = tiny_dflash2().config
    neither = SimpleNamespace(**{**vars(config), "dflash_config": {
        k: v for k, v in config.dflash_config.items() if k != "mask_token_id"}})
    draft = SimpleNamespace(hf_config=neither, model=str(tmp_path))
    with pytest.raises(DFlash2ConfigError) as e:
        CpuDFlash2Proposer(SimpleNamespace(speculative_config=SimpleNamespace(draft_model_config=draft)), "cpu")
    assert "top-level mask_token_id" in str(e.value) and f"{tmp_path}/config.json" in str(e.value)
