"""The beam-fsdpa-tiles port patch (beam_hpu/runtime/prefill/beam-fsdpa-tiles.toml) on the vllm-gaudi
tree named by GAUDI_FIXES_ROOT, on CPU.

The test takes from the (patched or unpatched) files themselves the statements that run prompt
attention with cached context: the end of HPUAttentionImpl.forward's prompt branch (the patch and
the `out = ops.prompt_attention(...)` call), ops.prompt_attention with _get_context, _include_past
and _fsdpa_prompt_attention, the KV cache's fetch_from_cache and the metadata processor's
_set_attn_bias, and runs them with a stand-in for FusedSDPA (torch SDPA with the bias as mask,
FusedSDPA's positional signature) that records every call's shapes. Checked: every call stays under
BEAM_FSDPA_WS_GIB, the result equals the stock single call, a chunk whose single call fits the bound
makes that call, and other models keep the stock call.
"""
from __future__ import annotations

import pytest
import torch

from beam_hpu.runtime.prefill.hpu_fsdpa_tiles import GIB, workspace_bytes
from tests.support.gaudi.prompt_attention import ATTN, CASES, PromptAttention
from tests.support.gaudi.tree import port_tree_fixture

pytestmark = pytest.mark.gaudi_tree
tree = port_tree_fixture("module")


def call_workspace(call):
    (b, hq, rows, _), (_, _, keys, _), _ = call
    return workspace_bytes(b, hq, rows, keys)


@pytest.mark.parametrize("ctx_len,seq_len,sliding", CASES)
@pytest.mark.parametrize("ws_gib,q_tile", [("0.01", "256"), ("0.004", "256"), ("2", "128")])
def test_beam_prompt_attention_with_context_keeps_the_bound_and_the_result(tree, monkeypatch, ctx_len, seq_len,
                                                                           sliding, ws_gib, q_tile):
    monkeypatch.setenv("BEAM_FSDPA_WS_GIB", "0")
    stock, stock_calls = PromptAttention(tree)(ctx_len, seq_len, sliding)
    monkeypatch.setenv("BEAM_FSDPA_WS_GIB", ws_gib)
    monkeypatch.setenv("BEAM_FSDPA_Q_TILE", q_tile)
    out, calls = PromptAttention(tree)(ctx_len, seq_len, sliding)
    assert len(stock_calls) == 1  # BEAM_FSDPA_WS_GIB=0: vllm-gaudi's single call, patched or not
    torch.testing.assert_close(out, stock, rtol=1e-5, atol=1e-5)
    if not tree.port:
        assert calls == stock_calls
        return
    if call_workspace(stock_calls[0]) <= float(ws_gib) * GIB:  # the single call fits: it is made as stock
        assert calls == stock_calls
        return
    assert float(ws_gib) < 2  # at these shapes only the small bounds are passed by the single call
    assert sum(c[0][2] for c in calls) == seq_len and len(calls) > 1
    for call in calls:
        assert call_workspace(call) <= float(ws_gib) * GIB, call
    assert all(c[0][2] <= int(q_tile) for c in calls)


def test_lazy_mode_marks_a_step_between_tiles(tree, monkeypatch):
    monkeypatch.setenv("BEAM_FSDPA_WS_GIB", "0.01")
    monkeypatch.setenv("BEAM_FSDPA_Q_TILE", "128")
    attention = PromptAttention(tree, bridge_mode="lazy")
    _, calls = attention(1000, 512, False)
    assert len(attention.marks) == (len(calls) - 1 if tree.port else 0)
    assert len(calls) == (4 if tree.port else 1)


def test_other_models_keep_the_single_call(tree, monkeypatch):
    monkeypatch.setenv("BEAM_FSDPA_WS_GIB", "0.004")
    _, calls = PromptAttention(tree, model_type="gemma3")(1000, 512, False)
    assert len(calls) == 1


def test_a_bad_switch_stops_the_call_naming_it(tree, monkeypatch):
    monkeypatch.setenv("BEAM_FSDPA_Q_TILE", "100")
    attention = PromptAttention(tree)
    if not tree.port:
        attention(1000, 256, False)  # stock never reads the switch
        return
    with pytest.raises(ValueError, match="BEAM_FSDPA_Q_TILE='100'"):
        attention(1000, 256, False)


def test_the_patch_sits_in_the_prompt_branch_only(tree):
    text = (tree.root / ATTN).read_text()
    assert text.count("beam-hpu fix beam-fsdpa-tiles") == (1 if tree.port else 0)
    assert ("tiled_fsdpa_op" in text) is tree.port
    # exactly the forward's prompt call is preceded by the patch; MLA and encoder-decoder are untouched
    assert text.count("ops.prompt_attention(") == 3

