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

import ast
import math
from types import SimpleNamespace

import pytest
import torch
from gaudi_source import find_def, load
from test_fixes_gaudi import copy_tree, pytestmark  # noqa: F401  (skip without GAUDI_FIXES_ROOT)
from test_port_patches import PORT_PROFILE, PORT_UNITS, apply, gaudi_units

from beam_hpu.runtime.sliding_window import hpu_window as win
from beam_hpu.runtime.prefill.hpu_fsdpa_tiles import GIB, workspace_bytes
from fixes.engine import EXIT_OK
from fixes.profile import load_profile

ATTN = "vllm_gaudi/attention/backends/hpu_attn.py"
OPS = "vllm_gaudi/extension/ops.py"
UTILS = "vllm_gaudi/extension/utils.py"
RUNNER = "vllm_gaudi/v1/worker/hpu_model_runner.py"
BS, W, HQ, HKV, D = 128, 512, 6, 1, 16


@pytest.fixture(scope="module", params=["v0.30.0 only", "port"])
def tree(request, tmp_path_factory):
    root, checkouts = copy_tree(tmp_path_factory.mktemp("site"))
    only = gaudi_units(load_profile(PORT_PROFILE))
    if request.param != "port":
        only = [n for n in only if n not in PORT_UNITS]
    report = apply(root, checkouts, only=only)
    assert report.exit_code == EXIT_OK, report.lines
    return SimpleNamespace(root=root, port=request.param == "port")


def prompt_call(path):
    """The statements of HPUAttentionImpl.forward from the port's `if` (when present) through
    `out = ops.prompt_attention(...)`, as one module."""
    forward = find_def(ast.parse(path.read_text()), "forward", "HPUAttentionImpl")
    for node in ast.walk(forward):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for i, stmt in enumerate(body):
            if (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call)
                    and ast.unparse(stmt.value.func) == "ops.prompt_attention"):
                start = i - 1 if i and isinstance(body[i - 1], ast.If) and "beam" in ast.unparse(body[i - 1]) else i
                return compile(ast.Module(body=body[start:i + 1], type_ignores=[]), str(path), "exec")
    raise AssertionError("no ops.prompt_attention call in HPUAttentionImpl.forward")


class StandInFusedSDPA:
    """FusedSDPA's role and positional signature; records (q, k, bias) shapes of every call."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, mask, dropout_p, is_causal, scale, softmax_mode, recompute_mode, valid_seq_lengths,
                 padding_side, *rest):
        assert mask is not None and dropout_p == 0.0 and not rest
        self.calls.append((tuple(q.shape), tuple(k.shape), tuple(mask.shape)))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), scale=scale,
                                                                enable_gqa=True)


class PromptAttention:
    """Prompt attention with cached context as the tree's files compute it, for one chunk."""

    def __init__(self, tree, model_type="beam", bridge_mode="eager"):
        config = SimpleNamespace(model_type=model_type, bridge_mode=bridge_mode, fp32_softmax=False,
                                 per_token_kv_scaling_support=False)
        get_config = lambda: config  # noqa: E731
        self.marks = []
        ops_path, utils_path = tree.root / OPS, tree.root / UTILS
        fetch_args = load(utils_path, "get_kv_fetch_extra_args", get_config=get_config)
        ops_globals = dict(torch=torch, math=math, get_config=get_config, USING_INC=False,
                           get_kv_fetch_extra_args=fetch_args,
                           htcore=SimpleNamespace(mark_step=lambda: self.marks.append(1)))
        for name in ("_get_all", "_include_past", "_get_context", "_fsdpa_prompt_attention",
                     "_naive_prompt_attention", "_flex_prompt_attention"):
            ops_globals[name] = load(ops_path, name, **ops_globals)
        self.ops = SimpleNamespace(prompt_attention=load(ops_path, "prompt_attention", **ops_globals),
                                   htcore=ops_globals["htcore"])
        fetch = load(utils_path, "fetch_from_cache", "VLLMKVCache")
        self.fetch = fetch.__get__(SimpleNamespace(use_contiguous_pa=False))
        self.set_bias = load(tree.root / RUNNER, "_set_attn_bias", "HPUAttentionMetadataProcessor", torch=torch,
                             math=math, custom_tuple_replace=lambda m, _n, **kw: SimpleNamespace(**{**vars(m), **kw}))
        self.code = prompt_call(tree.root / ATTN)
        self.get_config = get_config

    def __call__(self, ctx_len, seq_len, sliding, seed=0):
        """(output [1, S, HQ*D], the stand-in's calls) for a chunk of seq_len tokens after ctx_len."""
        g = torch.Generator().manual_seed(seed)
        num_blocks = 64
        key_cache = torch.randn(num_blocks * BS, HKV, D, generator=g)
        value_cache = torch.randn(num_blocks * BS, HKV, D, generator=g)
        blocks = list(range(3, 3 + math.ceil(ctx_len / BS)))  # the sequence's physical blocks
        query = torch.randn(1, seq_len, HQ * D, generator=g)
        key = torch.randn(seq_len, HKV, D, generator=g)
        value = torch.randn(seq_len, HKV, D, generator=g)
        ctx_t, seq_t = torch.tensor([ctx_len]), torch.tensor([seq_len])
        if sliding:  # what the beam-exact-window patch hands a sliding layer
            (blocks,), width = win.prefill_window_context([blocks], [ctx_len], W, BS)
            blocks = blocks + [0] * (width - len(blocks))
            attn_bias = win.prefill_window_bias(ctx_t, seq_t, W, BS, num_ctx_blocks=width, padded_batch=1,
                                                padded_query_len=seq_len, dtype=torch.bfloat16)
        else:  # the runner's own full-attention bias with context
            metadata = SimpleNamespace(is_prompt=True, attn_bias=None, block_list=torch.tensor(blocks),
                                       seq_lens_tensor=seq_t, context_lens_tensor=ctx_t, block_size=BS)
            processor = SimpleNamespace(prefill_use_fusedsdpa=True, block_size=BS)
            attn_bias = self.set_bias(processor, metadata, 1, seq_len, "cpu", torch.bfloat16).attn_bias
        kernel = StandInFusedSDPA()
        impl = SimpleNamespace(prefill_impl="fsdpa_impl", sliding_window=W if sliding else None)
        common_args = {"scale": D**-0.5, "fsdpa_op": kernel, "keys_fetch_func": self.fetch,
                       "values_fetch_func": self.fetch, "block_list": torch.tensor(blocks), "key_cache": key_cache,
                       "value_cache": value_cache, "block_size": BS, "sinks": None, "k_scales": None,
                       "v_scales": None}
        names = dict(self=impl, ops=self.ops, get_config=self.get_config, query=query, key=key, value=value,
                     query_shape=(1, seq_len, HQ, D), kv_shape=(1, -1, HKV, D), attn_bias=attn_bias,
                     position_bias=None, block_list=common_args["block_list"], common_args=common_args,
                     attn_metadata=SimpleNamespace(seq_lens_tensor=seq_t), __builtins__=__builtins__)
        exec(self.code, names)
        return names["out"], kernel.calls


def call_workspace(call):
    (b, hq, rows, _), (_, _, keys, _), _ = call
    return workspace_bytes(b, hq, rows, keys)


CASES = [(1000, 512, False), (3 * BS, 640, False), (W + 1, 768, True), (20 * BS + 7, 1024, True)]


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

