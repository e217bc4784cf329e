"""A model built on a vllm-gaudi tree's layers (hpu_layers.install()) prefilled and decoded through
the tree's own attention backend on CPU, in a tree child (tree.run_stubbed).

vLLM builds each Attention layer's impl from the backend the current platform names
(HpuPlatform.get_attn_backend_cls: HPUAttentionBackendV1, impl HPUAttentionImpl). Here every step
then runs as on a node, from the tree's files:
- the KV caches: HPUAttentionBackendV1.get_kv_cache_shape for the pool plus the runner's pad block,
  as (key, value, None, None) per layer (the runner's initialize_kv_cache layout for bf16), bound
  by vLLM's own bind_kv_cache;
- the prompt step's metadata: the runner's _form_prefill_batch; a decode step's: the runner's
  _create_decode_input_data (decode_step.py); both into the tree's HPUAttentionMetadataV1;
- trim_attn_metadata, HPUAttentionMetadataProcessor (its own __init__ and methods) and
  HpuModelAdapter.forward (with its cos/sin protocol) from the runner file, which vLLM 0.30.0
  cannot import whole; the adapter sets vLLM's forward context, where the tree's
  patched_attention_forward hands each layer the metadata and its cache.
Stand-ins: FusedSDPA and the card's matmul into an fp32 out (habana_attention.py); the runner's
async_h2d_copy to the host; a prompt bucket of the prompt's own size (no padding); the step's
sequence state (block table, context length).
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from tests.support.gaudi.decode_step import PaddedBatch, decode_step
from tests.support.gaudi.source import PROCESSOR_CLS, RUNNER, RUNNER_CLS, load


def install_attention_kernels(trace=None):
    """After hpu_layers.install(), before the model is built: FusedSDPA in the stand-in
    hpex.kernels module (install() made it without one; the tree's kernel loader must not have
    answered before, or its cached answer would be None; a `trace` wraps it there before the loader
    reads it), and the card's matmul into an fp32 out where the tree's Matmul module calls torch
    (habana_attention.py)."""
    from tests.support.gaudi.habana_attention import CardMatmulTorch, FusedSDPA
    from vllm_gaudi.extension import kernels, utils

    module = sys.modules["habana_frameworks.torch.hpex.kernels"]
    module.FusedSDPA = FusedSDPA
    if trace is not None:
        trace.wrap_hpex()
    assert kernels.fsdpa() is module.FusedSDPA, "the tree's fsdpa() loader answered before the stand-in was there"
    utils.torch = CardMatmulTorch()
    return FusedSDPA, CardMatmulTorch


def _host_copy(source, dest_tensor=None, dtype=None, device=None):
    """The runner's async_h2d_copy (vllm_gaudi/utils.py) with the host as the device."""
    if isinstance(source, torch.Tensor):
        return source.clone() if dest_tensor is None else dest_tensor.copy_(source)
    return torch.tensor(source, dtype=dtype)


def attention_impls(model) -> dict[str, str]:
    """{Attention layer name: its impl's module.class}."""
    from vllm.model_executor.layers.attention.attention import Attention

    return {name: f"{type(m.impl).__module__}.{type(m.impl).__name__}"
            for name, m in model.named_modules() if isinstance(m, Attention)}


class TreeAttentionRun:
    """One sequence prefilled, then decoded a token per step, through the tree's backend."""

    def __init__(self, root: Path, model, vllm_config, block_size: int, block_table: list[int],
                 decode_bucket: tuple[int, int] = (1, 0)):
        """decode_bucket: (batch, extra blocks) every decode step is padded to, as a node's
        bucketing pads it (padding rows write to the pad block; extra blocks are the pad block)."""
        from vllm.forward_context import set_forward_context
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.v1.worker.utils import bind_kv_cache
        from vllm_gaudi.extension.runtime import get_config
        from vllm_gaudi.extension.utils import align_and_pad, pad_list, with_default
        from vllm_gaudi.v1.attention.backends.hpu_attn import HPUAttentionBackendV1, HPUAttentionMetadataV1

        self.model, self.vllm_config, self.block_size = model, vllm_config, block_size
        self.block_table, self.decode_bucket = list(block_table), decode_bucket
        self.num_blocks = max(block_table) + 1  # the pool; the runner's pad block is this id
        self.runner_path = root / RUNNER
        self.metadata_cls = HPUAttentionMetadataV1
        vllm_config.cache_config.block_size = block_size
        runner = self.runner_path

        # KV caches as the runner's initialize_kv_cache allocates them (num_blocks + 1: the pad block)
        layers = vllm_config.compilation_config.static_forward_context
        caches = {}
        for name, layer in layers.items():
            if not isinstance(layer, Attention):  # the MoE runners live in the same context
                continue
            shape = HPUAttentionBackendV1.get_kv_cache_shape(self.num_blocks + 1, block_size, layer.num_kv_heads,
                                                             layer.head_size)
            caches[name] = (torch.zeros(shape, dtype=vllm_config.model_config.dtype),
                            torch.zeros(shape, dtype=vllm_config.model_config.dtype), None, None)
        self.kv_caches: list = []
        bind_kv_cache(caches, layers, self.kv_caches)

        # HPUAttentionMetadataProcessor: its own __init__ and methods, from the runner file
        type_cache: dict = {}
        replace = load(runner, "custom_tuple_replace", _TYPE_CACHE=type_cache)
        subtuple = load(runner, "subtuple", collections=collections, _TYPE_CACHE=type_cache, Optional=None)
        self.trim = load(runner, "trim_attn_metadata", subtuple=subtuple, HPUAttentionMetadataV1=HPUAttentionMetadataV1)
        names = dict(torch=torch, math=math, os=os, get_config=get_config,
                     is_interleaved=load(runner, "is_interleaved", Any=object),
                     with_default=with_default, logger=logging.getLogger("gaudi_tree"), custom_tuple_replace=replace,
                     # the runner's CPU branch of one_hot (negative block groups), as the tree tests take it
                     is_fake_hpu=lambda: True)
        methods = {n: load(runner, n, PROCESSOR_CLS, **names)
                   for n in ("__init__", "_set_attn_bias", "_set_attn_bias_for_sliding_window", "_set_block_mapping",
                             "process_metadata")}
        self.processor = type(PROCESSOR_CLS, (), methods)(vllm_config)
        assert self.processor.interleaved_sliding_window and self.processor.prefill_use_fusedsdpa

        # HpuModelAdapter: forward and its cos/sin protocol, over the real model
        adapter = SimpleNamespace(model=model, metadata_processor=self.processor, pooling_model=False,
                                  flatten_input=get_config().flatten_input, dtype=vllm_config.model_config.dtype,
                                  vllm_config=vllm_config, recompute_cos_sin=False, dummy_num_input_tokens=-1,
                                  dummy_num_tokens_across_dp_cpu=None)
        find = load(runner, "_get_rotary_embedding_module", "HpuModelAdapter")
        adapter._get_rotary_embedding_module = lambda m: find(adapter, m)
        adapter._rotary_embed_module = adapter._get_rotary_embedding_module(model)
        adapter._rotary_prepare_cos_sin = load(runner, "_get_prepare_cos_sin", "HpuModelAdapter")(adapter)
        reset = load(runner, "_reset_rotary_cos_sin", "HpuModelAdapter")
        adapter._reset_rotary_cos_sin = lambda: reset(adapter)
        forward = load(runner, "forward", "HpuModelAdapter", LoraMask=SimpleNamespace(setLoraMask=lambda m: None),
                       set_forward_context=set_forward_context, set_hpu_dp_metadata=lambda *a: contextlib.nullcontext(),
                       _mark_unbacked_dim0=lambda t: None)
        self.adapter_forward = lambda **kw: forward(adapter, **kw)
        self.adapter = adapter

        # The runner's prompt batch builder and its state for one sequence
        self.form_prefill = load(runner, "_form_prefill_batch", RUNNER_CLS, torch=torch, itertools=itertools,
                                 round_up=load(runner, "round_up"), align_and_pad=align_and_pad, pad_list=pad_list,
                                 async_h2d_copy=_host_copy, HPUAttentionMetadataV1=HPUAttentionMetadataV1,
                                 PrefillInputData=lambda **kw: SimpleNamespace(**kw))
        self.runner = SimpleNamespace(
            profiler=SimpleNamespace(enabled=False), attn_block_size=block_size, block_size=block_size,
            interleaved_sliding_window=self.processor.interleaved_sliding_window,
            sliding_window=self.processor.sliding_window, _get_model_type=lambda: "beam",
            _get_prompt_bucketing_fn=lambda: lambda query_lens, ctx_blocks: (len(query_lens), max(query_lens),
                                                                               max(ctx_blocks)),
            get_dp_padding=lambda n: 0, uses_mrope=False, use_merged_prefill=False, logits_rounding=1,
            num_mamba_like_layers=0, pin_memory=False, device="cpu", dtype=vllm_config.model_config.dtype)
        self.metadata: list = []  # every step's metadata as the runner built it

    def _run(self, token_ids: torch.Tensor, positions: torch.Tensor, metadata):
        """The adapter's forward ([B, S] ids and positions): its hidden states [rows, H] and, where
        the model was asked for auxiliary layers (a drafter's), theirs side by side [rows, A * H]."""
        from vllm.config import set_current_vllm_config

        self.metadata.append(metadata)
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            out = self.adapter_forward(input_ids=token_ids, positions=positions, attn_metadata=self.trim(metadata))
        hidden, aux = out if isinstance(out, tuple) else (out, None)
        rows = hidden.reshape(-1, hidden.shape[-1])
        return rows, None if aux is None else torch.cat([a.reshape(rows.shape[0], -1) for a in aux], dim=-1)

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            return self.model.compute_logits(rows).float()

    def _forward(self, token_ids: torch.Tensor, positions: torch.Tensor, metadata, logits_indices) -> torch.Tensor:
        """Logits of the sequence's row (the step's logits_indices, as the runner selects them)."""
        rows, _ = self._run(token_ids, positions, metadata)
        return self._logits(rows[logits_indices[:1].long()])[0]

    def prefill(self, ids: list[int], context: int = 0) -> torch.Tensor:
        """One prompt chunk, ids[context:], after `context` tokens already in the cache (an earlier
        chunk's); logits of its last token."""
        contents = SimpleNamespace(req_ids=["0"], token_ids=[list(ids[context:])], context_lens=[context],
                                   blocks=[self.block_table], logits_positions=[[len(ids) - context - 1]])
        batch = self.form_prefill(self.runner, contents)
        self.length = len(ids)
        return self._forward(batch.token_ids[0], batch.position_ids[0], batch.attn_metadata[0],
                             batch.logits_indices[0])

    def decode(self, token: int) -> torch.Tensor:
        table = torch.zeros((self.decode_bucket[0], len(self.block_table)), dtype=torch.int32)  # padding rows: 0
        table[0] = torch.tensor(self.block_table, dtype=torch.int32)
        step = decode_step(self.runner_path, block_table=table,
                           context_lens=[self.length], num_tokens=[1], token_ids=[[token]],
                           block_size=self.block_size, window=self.processor.sliding_window,
                           num_kv_blocks=self.num_blocks, bucketing=PaddedBatch(*self.decode_bucket))
        metadata = self.metadata_cls.make_decode_metadata(**vars(step.attn_metadata))
        self.length += 1
        return self._forward(step.token_ids, step.position_ids, metadata, step.logits_indices)

    def prefill_states(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole prompt in one step: (its last token's logits, every prompt row's auxiliary
        states [len(ids), A * H])."""
        contents = SimpleNamespace(req_ids=["0"], token_ids=[list(ids)], context_lens=[0],
                                   blocks=[self.block_table], logits_positions=[[len(ids) - 1]])
        batch = self.form_prefill(self.runner, contents)
        self.length = len(ids)
        rows, aux = self._run(batch.token_ids[0], batch.position_ids[0], batch.attn_metadata[0])
        return self._logits(rows[batch.logits_indices[0][:1].long()])[0], aux[:len(ids)]

    def verify_states(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A verify step: `tokens` (the last emitted token and the drafts) at the cache's next
        positions as the runner lays a decode of several tokens out (_create_decode_input_data);
        (each token's logits [n, V], its auxiliary states [n, A * H]). The cache keeps what the
        caller then `accept`s."""
        table = torch.zeros((self.decode_bucket[0], len(self.block_table)), dtype=torch.int32)
        table[0] = torch.tensor(self.block_table, dtype=torch.int32)
        step = decode_step(self.runner_path, block_table=table, context_lens=[self.length], num_tokens=[len(tokens)],
                           token_ids=[list(tokens)], block_size=self.block_size, window=self.processor.sliding_window,
                           num_kv_blocks=self.num_blocks, bucketing=PaddedBatch(*self.decode_bucket))
        metadata = self.metadata_cls.make_decode_metadata(**vars(step.attn_metadata))
        rows, aux = self._run(step.token_ids, step.position_ids, metadata)
        positions = step.position_ids.reshape(-1)
        ours = torch.stack([(positions == self.length + j).nonzero()[0, 0] for j in range(len(tokens))])
        return self._logits(rows[ours]), aux[ours]

    def accept(self, kept: int) -> None:
        """After a verify step: its first `kept` tokens stay in the sequence."""
        self.length += kept

    def greedy(self, ids: list[int], steps: int, chunks: tuple[int, ...] = ()) -> tuple[list[int], torch.Tensor]:
        """(the prompt's greedy continuation, each token's logits [steps, V]): the prompt prefilled
        in chunks ending at the given lengths, then the rest; its last logits choose the first
        token, each decode step's the next."""
        for end in chunks:
            self.prefill(ids[:end], context=getattr(self, "length", 0))
        logits = [self.prefill(ids, context=getattr(self, "length", 0))]
        tokens = [int(logits[-1].argmax())]
        while len(tokens) < steps:
            logits.append(self.decode(tokens[-1]))
            tokens.append(int(logits[-1].argmax()))
        return tokens, torch.stack(logits)
