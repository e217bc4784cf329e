"""A (patched) vllm-gaudi tree's own HPUModelRunner input preparation, run on CPU for whole steps.

`tree_runner_class` compiles, from the file, HPUModelRunner's step-building methods (_prepare_inputs
down to _create_decode_input_data, _form_prefill_batch, their dummy and spec-decode helpers, the
warm-up's _add_dummy_request and the drafting methods) into one class, with the module-level
records they build (BatchContents, PrefillInputData, DecodeInputData, merge_contents, ...) and the
tree's own async_h2d_copy, align_and_pad and pad_list (the host copy stays on the host). Stand-ins
only for what has no CPU form or no part in a step's inputs: the attention metadata record (a
namespace of what the builder passes), the bucketing manager (pads a prompt's length to a multiple
of 8 and a decode batch by one), the input batch (its per-request arrays and one block table per
KV-cache group) and the scheduler output.
"""
from __future__ import annotations

import ast
import functools
import itertools
import logging
import math
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional, TypeAlias, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from tests.support.gaudi.source import RUNNER_CLS, load, run_statements

STEP_METHODS = (
    "_prepare_inputs", "_prepare_prefill_inputs", "_extract_prefill_batch_contents", "_can_merge_prefill_contents",
    "_get_prompt_bucketing_fn", "_bucketize_2d_prompt", "_bucketize_merged_prompt", "_form_prefill_batch",
    "_make_attn_bias", "_create_dummy_prefill_batch_contents", "_prepare_decode_inputs",
    "_create_dummy_decode_input_data", "_create_decode_input_data", "get_habana_paged_attn_buffers",
    "_prepare_spec_decode_inputs", "_get_cumsum_and_arange", "_get_attention_group_id_for_hybrid",
    "_add_dummy_request", "propose_eagle_decode", "propose_eagle_prefill", "_prepare_input_ids",
    "propose_draft_token_ids")
MODULE_NAMES = ("BatchContents", "PrefillInputData", "DecodeInputData", "merge_contents", "shallow_tuple",
                "round_up", "flatten", "empty_list", "BucketingFailedException", "exact_decode_window",
                "mark_window_starts", "EXACT_DECODE_WINDOW_MODELS")


def _name(node) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return node.name
    target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
    return target.id if isinstance(target, ast.Name) else None


class HostBias(torch.Tensor):
    """The merged prefill's bias, which the builder sends `.to('hpu')`: stays on the host."""

    def to(self, *args, **kwargs):
        if args and args[0] == "hpu":
            return self
        return super().to(*args, **kwargs)


@functools.lru_cache(maxsize=4)
def tree_runner_class(runner_path: Path):
    """(the class of the file's step methods, the module namespace they run in)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    root = runner_path.parents[3]
    utils = root / "vllm_gaudi/extension/utils.py"
    pad_list = load(utils, "pad_list", itertools=itertools)
    h2d = load(root / "vllm_gaudi/utils.py", "async_h2d_copy", torch=torch)
    module = ast.parse(runner_path.read_text())
    picked = [n for n in module.body if _name(n) in MODULE_NAMES]
    cls = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == RUNNER_CLS)
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in STEP_METHODS]
    for m in methods:
        m.decorator_list = []
    runner = ast.ClassDef(name="TreeRunner", bases=[], keywords=[], body=methods, decorator_list=[], type_params=[])
    from dataclasses import dataclass, field, fields, replace
    # Dataclasses look their module up in sys.modules: the compiled records get one of their own.
    module_name = f"gaudi_tree_runner_{abs(hash(str(runner_path)))}"
    host_module = types.ModuleType(module_name)
    sys.modules[module_name] = host_module
    namespace = host_module.__dict__
    namespace.update(
        __builtins__=__builtins__, torch=torch, np=np, math=math, itertools=itertools,
        F=F, pad_sequence=pad_sequence, dataclass=dataclass, field=field, fields=fields, replace=replace,
        Callable=Callable, Optional=Optional, TypeAlias=TypeAlias, Union=Union, Mergeable=None,
        pad_list=pad_list, align_and_pad=load(utils, "align_and_pad", itertools=itertools, pad_list=pad_list),
        async_h2d_copy=lambda src, dest_tensor=None, dtype=None, device=None: h2d(src, dest_tensor, dtype, "cpu"),
        HPUAttentionMetadataV1=SimpleNamespace(
            make_prefill_metadata=lambda **kw: SimpleNamespace(is_prompt=True, **kw),
            make_decode_metadata=lambda **kw: SimpleNamespace(is_prompt=False, **kw)),
        SpecDecodeMetadata=SpecDecodeMetadata, SamplingParams=SamplingParams, NewRequestData=NewRequestData,
        AttentionSpec=AttentionSpec, cdiv=cdiv, has_kv_transfer_group=lambda: False,
        logger=logging.getLogger("gaudi_tree_runner"))
    run_statements([*picked, runner], runner_path, namespace)
    tree_cls = namespace["TreeRunner"]
    make_bias = tree_cls._make_attn_bias
    tree_cls._make_attn_bias = lambda self, *a: make_bias(self, *a).as_subclass(HostBias)
    return tree_cls, namespace


class GroupTables:
    """The input batch's block tables, one per KV-cache group (vLLM's MultiGroupBlockTable's
    indexing): `tables[g][b]` is request b's table in group g."""

    def __init__(self, tables: list[list[list[int]]], width: int):
        self.block_tables = []
        for rows in tables:
            t = torch.zeros((max(len(rows), 1), width), dtype=torch.int32)
            for b, row in enumerate(rows):
                t[b, :len(row)] = torch.tensor(row, dtype=torch.int32)
            self.block_tables.append(SimpleNamespace(get_cpu_tensor=lambda t=t: t))

    def __getitem__(self, g):
        return self.block_tables[g]


class Bucketing:
    def __init__(self, seq_step: int = 8, extra_batch: int = 1):
        self.seq_step, self.extra_batch = seq_step, extra_batch

    def find_prompt_bucket(self, bs, seq, blocks):
        return bs, -(-seq // self.seq_step) * self.seq_step, blocks

    def find_decode_bucket(self, bs, blocks, seed_buckets=False):
        return bs + self.extra_batch, 1, blocks


def make_runner(runner_path: Path, kv_cache_config, *, block_size: int, window: int, num_kv_blocks: int,
                merged_prefill: bool = False, dp_padding: int = 0, model_type: str = "beam",
                async_scheduling: bool = False):
    cls, _ = tree_runner_class(runner_path)
    runner = cls.__new__(cls)
    big = 4096
    positions = torch.zeros(big, dtype=torch.int64)
    input_ids = torch.zeros(big, dtype=torch.int32)  # the device copy is the host's: no previous step's samples
    vars(runner).update(
        kv_cache_config=kv_cache_config, attn_block_size=block_size, block_size=block_size,
        bucketing_manager=Bucketing(), get_dp_padding=lambda n: dp_padding, max_prefill_batch_size=4,
        max_num_tokens=big, use_merged_prefill=merged_prefill, logits_rounding=1,
        profiler=SimpleNamespace(enabled=False), interleaved_sliding_window=True, sliding_window=window,
        dtype=torch.float32, _get_model_type=lambda: model_type, num_mamba_like_layers=0, uses_mrope=False,
        use_async_scheduling=async_scheduling, use_structured_output=False, invalid_req_indices=[],
        _resolve_block=lambda b: b, _resolve_all_blocks=lambda t: t, pin_memory=False, use_contiguous_pa=False,
        _PAD_BLOCK_ID=num_kv_blocks, _PAD_SLOT_ID=num_kv_blocks * block_size, model_config=SimpleNamespace(
            dtype=torch.float32), model_has_chunked_attention=False, device="cpu", _dummy_num_blocks=64,
        arange_np=np.arange(big), positions_cpu=positions, positions_np=positions.numpy(),
        input_ids_cpu=input_ids, input_ids_hpu=input_ids, speculative_config=None, is_pooling_model=False,
        max_model_len=big)
    return runner


def set_batch(runner, seqs: list, tables: list[list[list[int]]], width: int, block_table=None) -> None:
    """The input batch for `seqs` (in batch order: objects with .rid, .tokens (through the step's
    drafts), .computed and .prompt_len), with tables[g][b] the block table of seqs[b] in group g.
    `block_table`: a real vLLM MultiGroupBlockTable (the runner's InputBatch's) to hold the rows,
    in place of a fresh table per group."""
    token_ids = np.zeros((max(len(seqs), 1), 4096), dtype=np.int32)
    for b, s in enumerate(seqs):
        token_ids[b, :len(s.tokens)] = s.tokens
    runner.input_batch = SimpleNamespace(
        req_ids=[s.rid for s in seqs], req_id_to_index={s.rid: b for b, s in enumerate(seqs)},
        num_computed_tokens_cpu=np.array([s.computed for s in seqs], dtype=np.int32),
        num_prompt_tokens=np.array([s.prompt_len for s in seqs], dtype=np.int32),
        token_ids_cpu=token_ids, token_ids_cpu_tensor=torch.from_numpy(token_ids), prev_sampled_token_ids=None,
        block_table=GroupTables(tables, width) if block_table is None else fill_rows(block_table, tables))


def fill_rows(block_table, tables: list[list[list[int]]]):
    """Row b of every group's table: the request's blocks in that group (MultiGroupBlockTable.add_row)."""
    for b in range(len(tables[0])):
        block_table.add_row(tuple(rows[b] for rows in tables), b)
    return block_table
