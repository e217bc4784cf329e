"""Block tables for a speculative verify step on vllm-gaudi's flat decode layout.

A verify step's decode query of sequence s carries k+1 tokens at consecutive positions
ctx_s, ctx_s + 1, .., ctx_s + k (the last accepted token, then the k drafts). vllm-gaudi's decode
path flattens them into rows of one token each (row s * num_tokens + j) and hands every row the
same block table: the sequence's first ceil((ctx_s + 1) / block_size) blocks. Attention then
treats the row's slot offset as the fill of that table's last block (`get_habana_paged_attn_buffers`
and the exact window both read the position as (len(table) - 1) * block_size + slot % block_size).
That holds for a row whose position lies in the block holding ctx_s; a row past a block boundary
(ctx_s % block_size + j >= block_size) gets a table one block short, so it attends a prefix of the
previous block instead of its own keys, in full-attention and sliding layers alike.

`verify_step_block_tables` gives every real row the table up to the block holding its own
position, so every row has its own causal (and, through `window.decode_window_tables`, its own
exact sliding) window. Padding rows (j at or past the sequence's scheduled tokens) keep the stock
table: they are not read.
"""

from __future__ import annotations

import torch


def verify_step_block_tables(block_table: torch.Tensor, context_lens: list[int], num_tokens_per_req: list[int],
                             num_tokens: int, block_size: int) -> list[list[int]]:
    """Rows s * num_tokens + j of the flat decode layout: sequence s's blocks through the one
    holding position context_lens[s] + j (for j < num_tokens_per_req[s]; the stock
    ceil((ctx + 1) / block_size) blocks for padding rows)."""
    if block_size < 1:
        raise ValueError(f"block size must be at least 1 token, got {block_size}")
    rows = []
    for s, ctx in enumerate(context_lens):
        ctx = int(ctx)
        stock = block_table[s, :ctx // block_size + 1].tolist()
        for j in range(num_tokens):
            if j < num_tokens_per_req[s]:
                need = (ctx + j) // block_size + 1
                if need > block_table.shape[1]:
                    raise ValueError(f"verify step: sequence {s} needs {need} blocks for position {ctx + j}, "
                                     f"its block table has {block_table.shape[1]}")
                rows.append(block_table[s, :need].tolist())
            else:
                rows.append(stock)
    return rows
