"""The sliding-window prefill of a (patched) vllm-gaudi tree, run from its file on CPU: which keys
each query row of a prefill chunk over cached context attends."""
from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import torch

from beam_hpu.scope import is_beam_model_type
from tests.support.gaudi.source import PROCESSOR_CLS, RUNNER_CLS, load, method_body_if, namespace_replace, run_block


def prefill_attended(tree, ctx_lens, query_lens, window, block_size, seq_len, context_blocks=None):
    """Run the patched _form_prefill_batch window statements and _set_attn_bias_for_sliding_window
    for a batch with cached context: per sequence, per real query row, the positions attended.
    `context_blocks` (default: distinct ids) may hold a window-sized cache's null block in the
    columns the window has left."""
    runner = SimpleNamespace(interleaved_sliding_window=True, sliding_window=window, attn_block_size=block_size,
                             _get_model_type=lambda: "beam")
    if context_blocks is None:
        context_blocks = [list(range(100 * (b + 1), 100 * (b + 1) + math.ceil(c / block_size)))
                          for b, c in enumerate(ctx_lens)]
    names = {"self": runner, "context_blocks": context_blocks, "context_lens": list(ctx_lens),
             "is_beam_model_type": is_beam_model_type}
    trim = method_body_if(tree.runner, "_form_prefill_batch", RUNNER_CLS,
                          "self.interleaved_sliding_window and is_beam_model_type(self._get_model_type())")
    names = run_block(trim, tree.runner, **names)
    gate = method_body_if(tree.runner, "_form_prefill_batch", RUNNER_CLS,
                          "self.interleaved_sliding_window and target_blocks > 0 and "
                          "(self._get_model_type() == 'gemma4' or is_beam_model_type(self._get_model_type()))")
    align = load(tree.root / "vllm_gaudi/extension/utils.py", "align_and_pad", itertools=itertools,
                 pad_list=load(tree.root / "vllm_gaudi/extension/utils.py", "pad_list", itertools=itertools))
    names = run_block(gate, tree.runner, **names, target_blocks=1, target_bs=len(ctx_lens), align_and_pad=align,
                      itertools=itertools, torch=torch,
                      async_h2d_copy=lambda x, dtype: torch.tensor(x, dtype=dtype))
    window_list = names["window_context_blocks_t"]
    processor = SimpleNamespace(
        prefill_use_fusedsdpa=True, use_window_sdpa=False, slice_thld=8192, slice_size=1024, block_size=block_size,
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="beam"))))
    set_bias = load(tree.runner, "_set_attn_bias_for_sliding_window", PROCESSOR_CLS, torch=torch,
                    custom_tuple_replace=namespace_replace)
    metadata = SimpleNamespace(is_prompt=True, block_list=torch.zeros(len(ctx_lens) * 40, dtype=torch.int32),
                               window_block_list=window_list, block_size=block_size,
                               context_lens_tensor=torch.tensor(ctx_lens, dtype=torch.int32),
                               seq_lens_tensor=torch.tensor(query_lens, dtype=torch.int32))
    bias = set_bias(processor, metadata, len(ctx_lens), seq_len, window, "cpu", torch.bfloat16).window_attn_bias
    per_seq = window_list.view(len(ctx_lens), -1)
    out = []
    for b, (ctx, q) in enumerate(zip(ctx_lens, query_lens)):
        col_of = {bid: col for col, bid in enumerate(context_blocks[b]) if bid != 0}  # 0: a freed column
        key_pos = [col_of[bid] * block_size + s if bid in col_of else None
                   for bid in per_seq[b].tolist() for s in range(block_size)] + [ctx + i for i in range(seq_len)]
        out.append([{key_pos[k] for k in range(len(key_pos)) if bias[b, 0, i, k] == 0} for i in range(q)])
    return out
