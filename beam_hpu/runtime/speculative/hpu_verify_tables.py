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
table: their outputs are not read.

A padding row is also a KV write. vllm-gaudi pads each sequence's positions with 0, so a padding
row's slot is that of the sequence's position 0 (block_table[s, 0] * block_size): its K/V (token 0,
attending the whole stock table) would overwrite the real position 0 in every layer, a key every
later full-attention query reads and that no later step rewrites; with prefix caching the block is
shared with other requests. Only padded sequences (past num_decodes) get vllm-gaudi's pad-block
slots. `verify_step_padding_slots` gives the padding rows of real sequences pad-block slots too.
"""

from __future__ import annotations

from collections.abc import Iterator

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


def verify_step_padding_slots(slot_mapping: torch.Tensor, num_tokens_per_req: list[int], num_decodes: int,
                              pad_slots: Iterator[int]) -> torch.Tensor:
    """slot_mapping ([padded batch, num_tokens], before flattening) with row j of every real
    sequence s (s < num_decodes) at or past num_tokens_per_req[s] pointed at the next slot of
    `pad_slots` (the runner's cycle over its pad block, so padding slots stay distinct); real rows
    and the padded sequences' rows are unchanged."""
    if slot_mapping.dim() != 2:
        raise ValueError(f"verify step: slot mapping must be [batch, tokens], got shape {tuple(slot_mapping.shape)}")
    if not 0 <= num_decodes <= min(slot_mapping.shape[0], len(num_tokens_per_req)):
        raise ValueError(f"verify step: {num_decodes} decodes for a slot mapping of {slot_mapping.shape[0]} "
                         f"sequences and {len(num_tokens_per_req)} token counts")
    num_tokens = slot_mapping.shape[1]
    out = slot_mapping.clone()
    for s in range(num_decodes):
        n = int(num_tokens_per_req[s])
        if not 1 <= n <= num_tokens:
            raise ValueError(f"verify step: sequence {s} schedules {n} tokens, the step has rows for 1..{num_tokens}")
        for j in range(n, num_tokens):
            out[s, j] = next(pad_slots)
    return out
