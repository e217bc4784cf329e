"""Run a (patched or v0.30.0-only) vllm-gaudi tree's own HPUModelRunner._create_decode_input_data
on CPU for one decode or verify step, and its bucketing manager.

The whole method runs from the file, with the runner's own get_habana_paged_attn_buffers and the
swa-decode-window helpers taken from the same file. Stand-ins only for what has no CPU form or no
part in the step's metadata: async_h2d_copy (the tensor stays on the host), the metadata and
result records (plain namespaces holding what the method builds), the runner's state (positions
and token ids of the scheduled tokens, block tables). The bucketing manager is the tree's own
HPUBucketingManager (extension/bucketing/common.py and file_strategy.py, executed without their
vllm_gaudi imports, with get_config answering the recipe's settings).
"""
from __future__ import annotations

import functools
import itertools
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from tests.support.gaudi.source import RUNNER_CLS, exec_module, load

BUCKETING = "vllm_gaudi/extension/bucketing"


def bucketing_manager(root: Path, config: SimpleNamespace):
    """The tree's HPUBucketingManager class, reading `config` where it calls get_config()."""
    log = logging.getLogger("gaudi_tree_bucketing")
    common = dict(get_config=lambda: config, logger=lambda: log, boolean=lambda v: str(v).lower() in ("1", "true"))
    strategy = exec_module(root / BUCKETING / "file_strategy.py", get_config=lambda: config,
                                           logger=log)
    module = exec_module(root / BUCKETING / "common.py", **common,
                                         FileBucketingStrategy=strategy["FileBucketingStrategy"],
                                         ExponentialBucketingStrategy=None, LinearBucketingStrategy=None,
                                         PaddingAwareBucketingStrategy=None)
    return module["HPUBucketingManager"]


def recipe_bucket_config(bucket_file: Path) -> SimpleNamespace:
    """get_config() under the recipe's env: VLLM_BUCKETING_FROM_FILE, VLLM_CONTIGUOUS_PA=false."""
    return SimpleNamespace(VLLM_BUCKETING_FROM_FILE=str(bucket_file), use_contiguous_pa=False, merged_prefill=False,
                           PT_HPU_SDPA_QKV_SLICE_MODE_FWD=False, VLLM_PROMPT_CTX_BUCKET_MAX=None,
                           bucketing_strategy="exp")


class PaddedBatch:
    """A bucketing manager stand-in for steps that only need a padded batch: every lookup pads
    the batch to `batch` and the blocks to themselves plus `extra`."""

    def __init__(self, batch: int, extra: int = 0):
        self.batch, self.extra = batch, extra

    def find_decode_bucket(self, batch_size, num_blocks, seed_buckets=False):
        return (max(self.batch, batch_size), 1, num_blocks + self.extra)


@functools.lru_cache(maxsize=4)
def decode_functions(runner_path: Path):
    """(_create_decode_input_data, get_habana_paged_attn_buffers) of the file, parsed once."""
    helpers = dict(torch=torch, np=np, itertools=itertools, math=math)
    exact = load(runner_path, "exact_decode_window", **helpers)
    marks = load(runner_path, "mark_window_starts", **helpers)
    paged = load(runner_path, "get_habana_paged_attn_buffers", RUNNER_CLS, **helpers,
                 flatten=lambda x: list(itertools.chain(*x)),
                 pad_list=lambda lst, n, gen: lst + list(itertools.islice(gen, max(0, n - len(lst)))))
    method = load(runner_path, "_create_decode_input_data", RUNNER_CLS, **helpers, F=F, pad_sequence=pad_sequence,
                  async_h2d_copy=lambda t, device=None, dtype=None: t,
                  HPUAttentionMetadataV1=SimpleNamespace(make_decode_metadata=lambda **kw: SimpleNamespace(**kw)),
                  DecodeInputData=lambda **kw: SimpleNamespace(**kw),
                  EXACT_DECODE_WINDOW_MODELS=("gpt_oss", ), exact_decode_window=exact, mark_window_starts=marks)
    return method, paged


def decode_step(runner_path: Path, *, block_table: torch.Tensor, context_lens: list[int], num_tokens: list[int],
                token_ids: list[list[int]], block_size: int, window: int, num_kv_blocks: int, bucketing,
                model_type: str = "beam") -> SimpleNamespace:
    """_create_decode_input_data for decodes whose sequence s has context_lens[s] tokens in the
    cache and schedules num_tokens[s] tokens (token_ids[s]) at positions context_lens[s] + j.
    Returns the method's DecodeInputData (attn_metadata holds slot_mapping, block_list, ...)."""
    method, paged = decode_functions(runner_path)
    positions = [c + j for c, n in zip(context_lens, num_tokens) for j in range(n)]
    ids = [t for row in token_ids for t in row]
    runner = SimpleNamespace(
        attn_block_size=block_size, block_size=block_size, bucketing_manager=bucketing, get_dp_padding=lambda n: 0,
        positions_cpu=torch.tensor(positions, dtype=torch.int64), input_ids_cpu=torch.tensor(ids, dtype=torch.int32),
        uses_mrope=False, pin_memory=False, _PAD_BLOCK_ID=num_kv_blocks, _PAD_SLOT_ID=num_kv_blocks * block_size,
        _resolve_block=lambda b: b, _resolve_all_blocks=lambda tables: tables, use_contiguous_pa=False,
        model_config=SimpleNamespace(dtype=torch.float32), interleaved_sliding_window=True, sliding_window=window,
        _get_model_type=lambda: model_type, model_has_chunked_attention=False, num_mamba_like_layers=0,
        use_async_scheduling=False, device="cpu")
    runner.get_habana_paged_attn_buffers = lambda *a, **k: paged(runner, *a, **k)
    return method(runner, len(context_lens), list(num_tokens), np.array(context_lens), block_table, None)


def write_kv(utils_path: Path, cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One layer's K (or V) write of the step, by the tree's VLLMKVCache.forward on the slot
    mapping the HPU attention flattens (hpu_attn.py: `attn_metadata.slot_mapping.flatten()`)."""
    forward = load(utils_path, "forward", "VLLMKVCache")
    return forward(None, values, cache, slot_mapping.flatten())


NUM_KV_BLOCKS = 512  # the padded steps' pool; the pad block is this id
WINDOW = 8  # the sliding window of the padded steps


def padded_step(tree, bs, context_lens, num_tokens, shared_first_block=True, padded_batch=4, model_type="beam"):
    """(block tables, the step) of sequences with distinct tables, padded to `padded_batch` rows."""
    tables = torch.stack([torch.arange(100 * (s + 1), 100 * (s + 1) + 32, dtype=torch.int32)
                          for s in range(padded_batch)])
    if shared_first_block:  # sequence 1 hit the prefix cache on sequence 0's first (full) block
        tables[1, 0] = tables[0, 0]
    tokens = [[7 + j for j in range(n)] for n in num_tokens]
    out = decode_step(tree.runner, block_table=tables, context_lens=context_lens, num_tokens=num_tokens,
                      token_ids=tokens, block_size=bs, window=WINDOW, num_kv_blocks=NUM_KV_BLOCKS,
                      bucketing=PaddedBatch(padded_batch), model_type=model_type)
    return tables, out


def cached_keys(tables, context_lens, bs):
    """(slot, sequence, position) of every key already in the cache before the step (a shared
    prefix block's slots appear once per sequence)."""
    return [(int(tables[s, p // bs]) * bs + p % bs, s, p) for s, c in enumerate(context_lens) for p in range(c)]
