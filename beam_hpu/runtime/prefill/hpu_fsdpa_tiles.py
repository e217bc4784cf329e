"""One prefill chunk's attention over cached + chunk keys, in query tiles with a bounded workspace.

vllm-gaudi's prompt attention with cached context (`extension/ops.py`: `_get_context`, then
`_fsdpa_prompt_attention`) concatenates every cached key and value of the chunk's sequences and
calls FusedSDPA once, with a dense `[B, 1, S, C + S]` additive bias (C context slots, then the
chunk's own S keys, chunk row i at position ctx_len + i). The kernel's workspace grows with S * (C + S):
a 4,096-token chunk against 256K cached keys does not fit next to the weights and KV cache of a
card. This module computes the same attention in tiles of query rows, each tile against only the
keys its rows can attend, so every call stays under a bound (BEAM_FSDPA_WS_GIB) and no bias plane
reaches FusedSDPA's 32-bit byte-offset limit.

Rows of attention are independent: a tile's softmax over its keys is already complete, so the tiles
concatenate with no rescaling. A tile leaves out only keys that are masked for all of its rows (the
chunk keys after its last row; for a sliding layer also the keys before its first row's window), so
the result is the untiled one up to the order of floating-point sums. The key range comes from
shapes alone (nothing reads a device value on the host): a sliding layer's context is at most
`window.window_block_count` blocks once the beam-exact-window patch trimmed it, and the tile takes
all of it or none of it.

Shapes follow the kernel: query [B, Hq, S, D], key / value [B, Hkv, C + S, D] (GQA: Hq a multiple
of Hkv; Beam at TP 8 has 6 query heads and 1 KV head per card), bias [B, 1 or Hq, S, C + S].

SSMax is not applied here. Beam's NoPE layers scale q in the model (`beam_hpu/model/beam.py`,
`ssmax_query_scale`) before vLLM's Attention layer, which on Gaudi is the attention backend the port
patch sits in: q arrives scaled, and scaling it here would scale it twice.

    python -m beam_hpu.runtime.prefill.hpu_fsdpa_tiles --table   # the recipe's workspace per chunk
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from beam_hpu.settings import switches
from beam_hpu.settings.switches import FSDPA_Q_TILE_STEP
from beam_hpu.runtime.sliding_window.hpu_window import first_window_key, window_block_count

GIB = 2**30
# FusedSDPA addresses each query-by-key plane of the bias with a signed 32-bit byte offset: a plane
# of 2**31 bytes or more returns NaN without an error (vllm-gaudi PR #1749, measured on Gaudi 3).
BIAS_PLANE_LIMIT_BYTES = 2**31
# The workspace model holds the scores in fp32 whatever the softmax mode: the larger of the two.
SCORE_BYTES = 4

# (query, key, value, bias) -> output, all in the kernel's [B, heads, tokens, D] layout.
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def workspace_bytes(batch: int, q_heads: int, rows: int, keys: int, *, bias_bytes: int = 2,
                    score_bytes: int = SCORE_BYTES) -> int:
    """Bytes one attention call over `rows` queries and `keys` keys holds: the scores of every query
    head ([B, Hq, rows, keys] in `score_bytes`) and its bias tile ([B, 1, rows, keys] in the bias
    dtype, bf16 on Gaudi). It is the size of an unfused attention's intermediates, the model behind
    the recipe's figures (24 GiB of scores for a 4,096-token chunk over 256K keys, ~1.5 GiB for a
    256-row tile); FusedSDPA's real allocation is not published and may be smaller."""
    return batch * rows * keys * (q_heads * score_bytes + bias_bytes)


def tile_rows(query_len: int, keys: int, *, batch: int, q_heads: int, q_tile: int, ws_gib: float,
              bias_bytes: int = 2, score_bytes: int = SCORE_BYTES) -> int:
    """Query rows per call for a chunk of `query_len` rows against `keys` keys (the chunk's whole
    key set: no tile sees more, so the choice holds for every tile).

    `ws_gib` 0: the whole chunk in one call (vllm-gaudi's stock call). Otherwise the whole chunk too
    wherever one call fits: its workspace (`workspace_bytes`) within `ws_gib` GiB and its bias plane
    under BIAS_PLANE_LIMIT_BYTES. Only a chunk that does not fit is tiled: in `q_tile` rows when
    that many fit, else (and with `q_tile` 0) in the fewest tiles, the most rows that fit rounded
    down to the query bucket step (FSDPA_Q_TILE_STEP) when at least one step fits.
    """
    if query_len < 1 or keys < 1:
        raise ValueError(f"prefill attention needs at least one query row and key, got {query_len} and {keys}")
    if ws_gib == 0:
        return query_len
    per_row = workspace_bytes(batch, q_heads, 1, keys, bias_bytes=bias_bytes, score_bytes=score_bytes)
    fit = min(int(ws_gib * GIB) // per_row, (BIAS_PLANE_LIMIT_BYTES - 1) // (keys * bias_bytes))
    if fit < 1:
        raise ValueError(
            f"BEAM_FSDPA_WS_GIB={ws_gib:g}: one query row against {keys} keys needs "
            f"{per_row / GIB:.3g} GiB of attention workspace ({batch} sequence(s), {q_heads} query heads); "
            "raise the bound")
    if query_len <= fit:
        return query_len
    if 0 < q_tile <= fit:
        return q_tile
    return fit // FSDPA_Q_TILE_STEP * FSDPA_Q_TILE_STEP or fit


def tile_key_range(first_row: int, end_row: int, ctx_slots: int, window: int | None) -> tuple[int, int]:
    """[start, end) of the keys query rows first_row..end_row-1 of a chunk can attend, in the layout
    [ctx_slots context slots | the chunk's keys], for every context length the slots may hold.

    Causal: no key after the tile's last row. Sliding window (`window` tokens): the tile's first row
    (at position ctx + first_row) reaches back to position ctx + first_row - window + 1; when that is
    inside the chunk, neither the context nor the chunk rows before it are attended by any row of the
    tile. Otherwise the tile takes the whole context (its first attended slot depends on the context
    length, which only the device holds). Each batch row is one sequence whose chunk row r sits at
    position ctx + r: vllm-gaudi never merges a request that has cached context with another one
    (`_can_merge_prefill_contents`, merged prefill included), so no row belongs to a second sequence.
    """
    end = ctx_slots + end_row
    if window is None:
        return 0, end
    oldest = first_window_key(first_row, window)  # the first row's oldest key, as a chunk row (>= 0)
    reaches_context = first_row - oldest < window - 1  # the clamp at 0 cut the window short
    return (0 if reaches_context else ctx_slots + oldest), end


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias: torch.Tensor,
                      kernel: Kernel, *, q_tile: int, ws_gib: float, window: int | None = None,
                      between_tiles: Callable[[], None] | None = None) -> torch.Tensor:
    """The chunk's attention, computed in `tile_rows` query tiles with `kernel` (FusedSDPA on Gaudi,
    torch's scaled_dot_product_attention on CPU); [B, Hq, S, D] like the kernel's output.

    `window`: the layer's sliding window (None: full attention). `between_tiles`: called after every
    tile but the last (the port passes htcore.mark_step in lazy mode, so the lazy graph runs one
    tile at a time instead of holding every tile's workspace in one graph, as vllm-gaudi's own
    query tiling in PR #1749 does).
    """
    batch, q_heads, rows_total, _ = query.shape
    keys_total = key.shape[-2]
    ctx_slots = keys_total - rows_total
    if ctx_slots < 0 or value.shape[-2] != keys_total or attn_bias.shape[-2:] != (rows_total, keys_total):
        raise ValueError(
            f"prefill attention with context: query {tuple(query.shape)}, key {tuple(key.shape)}, "
            f"value {tuple(value.shape)} and bias {tuple(attn_bias.shape)} are not [B, Hq, S, D], "
            "[B, Hkv, C + S, D] and [B, 1, S, C + S]")
    if q_heads % key.shape[1]:
        raise ValueError(f"prefill attention: {q_heads} query heads are not a multiple of {key.shape[1]} KV heads")
    rows = tile_rows(rows_total, keys_total, batch=batch, q_heads=q_heads, q_tile=q_tile, ws_gib=ws_gib,
                     bias_bytes=attn_bias.element_size())
    if rows >= rows_total:
        return kernel(query, key, value, attn_bias)
    tiles = []
    for first in range(0, rows_total, rows):
        end = min(first + rows, rows_total)
        k0, k1 = tile_key_range(first, end, ctx_slots, window)
        tiles.append(kernel(query[:, :, first:end], key[:, :, k0:k1], value[:, :, k0:k1],
                            attn_bias[:, :, first:end, k0:k1]))
        if between_tiles is not None and end < rows_total:
            between_tiles()
    return torch.cat(tiles, dim=2)


def sdpa_kernel(scale: float) -> Kernel:
    """The CPU kernel: torch's scaled_dot_product_attention with the bias as an additive mask."""

    def kernel(q, k, v, bias):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=bias.to(q.dtype), scale=scale, enable_gqa=k.shape[1] != q.shape[1])

    return kernel


def fsdpa_tile_switches(env: Mapping[str, str] | None = None) -> tuple[int, float]:
    """(BEAM_FSDPA_Q_TILE, BEAM_FSDPA_WS_GIB) from the switch table's reader."""
    return switches.current("BEAM_FSDPA_Q_TILE", env), switches.current("BEAM_FSDPA_WS_GIB", env)


def tiled_fsdpa_op(fsdpa_op: Callable, window: int | None, *, env: Mapping[str, str] | None = None,
                   between_tiles: Callable[[], None] | None = None) -> Callable:
    """vllm-gaudi's `fsdpa_op` wrapped for the port patch: the same positional call
    `_fsdpa_prompt_attention` makes (query, key, value, attn_bias, then dropout, is_causal, scale,
    softmax mode, ... passed through to every tile), computed by `prefill_attention`."""
    q_tile, ws_gib = fsdpa_tile_switches(env)

    def tiled(query, key, value, attn_bias, *args):
        return prefill_attention(query, key, value, attn_bias, lambda q, k, v, b: fsdpa_op(q, k, v, b, *args),
                                 q_tile=q_tile, ws_gib=ws_gib, window=window, between_tiles=between_tiles)

    return tiled


# ---------------------------------------------------------------- the recipe's figures

RECIPE_Q_HEADS = 6  # Beam's 48 query heads at TP 8
RECIPE_CHUNK = 4096  # --max-num-batched-tokens
RECIPE_BLOCK = 128
RECIPE_WINDOW = 512


def recipe_calls(ctx_len: int, *, sliding: bool, q_tile: int, ws_gib: float, chunk: int = RECIPE_CHUNK,
                 q_heads: int = RECIPE_Q_HEADS, block_size: int = RECIPE_BLOCK,
                 window: int = RECIPE_WINDOW) -> list[tuple[int, int]]:
    """(rows, keys) of every kernel call for one chunk after `ctx_len` cached tokens, shapes only.
    A sliding layer's context is the beam-exact-window trim (window_block_count blocks at most)."""
    blocks = -(-ctx_len // block_size)
    if sliding:
        blocks = min(blocks, window_block_count(window, block_size))
    ctx_slots = blocks * block_size
    keys = ctx_slots + chunk
    rows = tile_rows(chunk, keys, batch=1, q_heads=q_heads, q_tile=q_tile, ws_gib=ws_gib)
    if rows >= chunk:
        return [(chunk, keys)]
    out = []
    for first in range(0, chunk, rows):
        end = min(first + rows, chunk)
        k0, k1 = tile_key_range(first, end, ctx_slots, window if sliding else None)
        out.append((end - first, k1 - k0))
    return out


def workspace_table(contexts=(16384, 65536, 131072, 262144), *, q_tile: int = 256, ws_gib: float = 2) -> str:
    """Per chunk, untiled (BEAM_FSDPA_WS_GIB=0) vs tiled workspace of a full-attention layer's
    largest call at the recipe's shapes (rows x keys, number of calls), and a sliding layer's."""
    lines = [f"TP 8 card: {RECIPE_Q_HEADS} query heads, chunk {RECIPE_CHUNK} tokens, fp32 scores + bf16 bias; "
             f"tiled = BEAM_FSDPA_Q_TILE={q_tile}, BEAM_FSDPA_WS_GIB={ws_gib:g}",
             "| cached context | untiled: one call | tiled: largest call | calls | ratio "
             "| sliding layer: untiled, tiled |",
             "|---|---|---|---|---|---|"]
    for ctx in contexts:
        (rows, keys), = recipe_calls(ctx, sliding=False, q_tile=q_tile, ws_gib=0)
        untiled = workspace_bytes(1, RECIPE_Q_HEADS, rows, keys)
        calls = recipe_calls(ctx, sliding=False, q_tile=q_tile, ws_gib=ws_gib)
        tiled = max(workspace_bytes(1, RECIPE_Q_HEADS, r, k) for r, k in calls)
        sliding = [max(workspace_bytes(1, RECIPE_Q_HEADS, r, k)
                       for r, k in recipe_calls(ctx, sliding=True, q_tile=q_tile, ws_gib=bound))
                   for bound in (0, ws_gib)]
        lines.append(f"| {ctx // 1024}K | {untiled / GIB:.2f} GiB ({rows} x {keys}) | {tiled / GIB:.3f} GiB "
                     f"({calls[-1][0]} x {calls[-1][1]}) | {len(calls)} | {untiled / tiled:.1f}x | "
                     f"{sliding[0] / GIB * 1024:.0f} MiB, {sliding[1] / GIB * 1024:.1f} MiB |")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="store_true", help="print the recipe's per-chunk workspace table")
    parser.add_argument("--q-tile", type=int, default=256)
    parser.add_argument("--ws-gib", type=float, default=2)
    ns = parser.parse_args()
    if not ns.table:
        parser.error("nothing to do: pass --table")
    print(workspace_table(q_tile=ns.q_tile, ws_gib=ns.ws_gib))
