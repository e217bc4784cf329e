"""Prompt attention with cached context as a (patched) vllm-gaudi tree's files compute it, for one
chunk on CPU: HPUAttentionImpl.forward's statements through `ops.prompt_attention`, the tree's
ops.py and utils.py (fetch_from_cache), and the runner's _set_attn_bias; the FusedSDPA kernel is a
stand-in with its role and signature (torch SDPA), recording the shapes of every call."""
from __future__ import annotations

import ast
import math
from types import SimpleNamespace

import torch

from beam_hpu.runtime.sliding_window import hpu_window as win
from tests.support.gaudi.source import find_def, load, namespace_replace, run_statements

ATTN = "vllm_gaudi/attention/backends/hpu_attn.py"
OPS = "vllm_gaudi/extension/ops.py"
UTILS = "vllm_gaudi/extension/utils.py"
RUNNER = "vllm_gaudi/v1/worker/hpu_model_runner.py"
BS, W, HQ, HKV, D = 128, 512, 6, 1, 16


def prompt_call(path):
    """The statements of HPUAttentionImpl.forward from the port's `if` (when present) through
    `out = ops.prompt_attention(...)`."""
    forward = find_def(ast.parse(path.read_text()), "forward", "HPUAttentionImpl")
    for node in ast.walk(forward):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for i, stmt in enumerate(body):
            if (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call)
                    and ast.unparse(stmt.value.func) == "ops.prompt_attention"):
                start = i - 1 if i and isinstance(body[i - 1], ast.If) and "beam" in ast.unparse(body[i - 1]) else i
                if start and isinstance(body[start - 1], ast.ImportFrom) and body[start - 1].module == "beam_hpu.scope":
                    start -= 1  # the port's `if` asks beam_hpu.scope, imported just before it
                return body[start:i + 1]
    raise AssertionError("no ops.prompt_attention call in HPUAttentionImpl.forward")


def module_constants(path, *names) -> dict:
    """The module-level assignments of `names` the file at `path` has (a tree may lack them)."""
    nodes = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id in names for t in n.targets)]
    namespace = run_statements(nodes, path, {})
    return {n: namespace[n] for n in names if n in namespace}


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
        # enable_fsdpa_q_tiling: the release's own query tiling (VLLM_HPU_FSDPA_Q_TILE_ENABLE), off
        # unless asked for, as the recipe leaves it; trees before it never read it
        config = SimpleNamespace(model_type=model_type, bridge_mode=bridge_mode, fp32_softmax=False,
                                 per_token_kv_scaling_support=False, enable_fsdpa_q_tiling=False)
        get_config = lambda: config  # noqa: E731
        self.marks = []
        ops_path, utils_path = tree.root / OPS, tree.root / UTILS
        fetch_args = load(utils_path, "get_kv_fetch_extra_args", get_config=get_config)
        ops_globals = dict(torch=torch, math=math, get_config=get_config, USING_INC=False,
                           get_kv_fetch_extra_args=fetch_args,
                           htcore=SimpleNamespace(mark_step=lambda: self.marks.append(1)))
        ops_globals.update(module_constants(ops_path, "_FSDPA_PLANE_MAX_BYTES"))
        for name in ("_get_all", "_include_past", "_get_context", "_fsdpa_num_q_tiles", "_fsdpa_prompt_attention",
                     "_naive_prompt_attention", "_flex_prompt_attention"):
            ops_globals[name] = load(ops_path, name, **ops_globals)
        self.ops = SimpleNamespace(prompt_attention=load(ops_path, "prompt_attention", **ops_globals),
                                   htcore=ops_globals["htcore"])
        fetch = load(utils_path, "fetch_from_cache", "VLLMKVCache")
        self.fetch = fetch.__get__(SimpleNamespace(use_contiguous_pa=False))
        self.set_bias = load(tree.root / RUNNER, "_set_attn_bias", "HPUAttentionMetadataProcessor", torch=torch,
                             math=math, custom_tuple_replace=namespace_replace)
        self.path = tree.root / ATTN
        self.statements = prompt_call(self.path)
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
                     attn_metadata=SimpleNamespace(seq_lens_tensor=seq_t))
        run_statements(self.statements, self.path, names)
        return names["out"], kernel.calls


# (context length, chunk length, sliding layer): full and sliding layers, chunks over several tiles
CASES = [(1000, 512, False), (3 * BS, 640, False), (W + 1, 768, True), (20 * BS + 7, 1024, True)]
