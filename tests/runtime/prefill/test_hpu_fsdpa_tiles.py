"""Prompt attention with cached context in bounded query tiles (beam_hpu/runtime/prefill/hpu_fsdpa_tiles.py).

The tiled result is checked against attention written out by its definition (fp32 softmax over
every key of the chunk's key set, under the bias beam_hpu.runtime.sliding_window.hpu_window builds for the runner), across
tile edges, window edges and block edges with block size 128, and for a 4,096-token chunk against
32K cached tokens. The workspace checks run the real function on meta tensors (shapes only) at the
recipe's shapes for 16K..256K of context.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from beam_hpu.settings.switches import FSDPA_Q_TILE_STEP, SwitchError
from beam_hpu.runtime.prefill import hpu_fsdpa_tiles as pa
from beam_hpu.runtime.sliding_window import hpu_window as win

REPO = Path(__file__).resolve().parents[3]
BS = 128
W = 512
FULL = 10**9  # a "window" wider than any position: window.prefill_window_mask is then plain causal


@pytest.fixture(autouse=True, scope="module")
def two_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(min(2, before))
    yield
    torch.set_num_threads(before)


def chunk_bias(ctx_lens, query_lens, seq_len, sliding):
    """The bias the (patched) runner hands the attention for a prefill chunk with context, and the
    number of context slots before the chunk's keys."""
    if sliding:
        blocks = win.window_block_count(W, BS)
        bias = win.prefill_window_bias(torch.tensor(ctx_lens), torch.tensor(query_lens), W, BS,
                                       num_ctx_blocks=blocks, padded_batch=len(ctx_lens),
                                       padded_query_len=seq_len, dtype=torch.bfloat16)
        return bias, blocks * BS
    blocks = max(-(-c // BS) for c in ctx_lens)
    mask = win.prefill_window_mask(ctx_lens, query_lens, FULL, BS, num_ctx_blocks=blocks, padded_query_len=seq_len)
    return win.mask_to_bias(mask).unsqueeze(1), blocks * BS


def definition(q, k, v, bias, scale, rows_per_step=512):
    """softmax(q k^T * scale + bias) v over all keys, fp32, GQA by head groups; computed a few
    hundred rows at a time only to bound this reference's memory (each row sees every key)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = []
    for r in range(0, q.shape[2], rows_per_step):
        scores = q[:, :, r:r + rows_per_step] @ k.transpose(-1, -2) * scale + bias[:, :, r:r + rows_per_step].float()
        out.append(torch.softmax(scores, dim=-1) @ v)
    return torch.cat(out, dim=2)


class Recorder:
    """A kernel with FusedSDPA's role (torch SDPA, or nothing on meta tensors) that records shapes."""

    def __init__(self, scale):
        self.calls = []
        self.sdpa = pa.sdpa_kernel(scale)

    def __call__(self, q, k, v, bias):
        self.calls.append((tuple(q.shape), tuple(k.shape), tuple(bias.shape)))
        if q.is_meta:
            return torch.empty(q.shape, device="meta", dtype=q.dtype)
        return self.sdpa(q, k, v, bias)


def tensors(batch, q_heads, kv_heads, rows, keys, dim, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed) if device == "cpu" else None
    make = (lambda *s: torch.randn(*s, generator=g)) if device == "cpu" else (
        lambda *s: torch.empty(*s, device=device))
    return make(batch, q_heads, rows, dim), make(batch, kv_heads, keys, dim), make(batch, kv_heads, keys, dim)


def bound_for(rows, q, k):
    """The BEAM_FSDPA_WS_GIB that holds exactly `rows` query rows of this call (fp32 scores, bf16
    bias), so a chunk of more rows is tiled."""
    return pa.workspace_bytes(q.shape[0], q.shape[1], rows, k.shape[-2]) / pa.GIB


def assert_rows_match(got, want, query_lens):
    for b, n in enumerate(query_lens):  # padding rows of a padded batch are nobody's output
        torch.testing.assert_close(got[b, :, :n], want[b, :, :n], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- equal to the untiled attention

EDGE_CASES = [
    # (ctx_lens, query_lens, padded S, q_tile): block edges 127/128/129, a window's worth of context,
    # a chunk that is not a whole number of tiles, a padded batch with short chunks.
    ([127, 128, 129], [640, 640, 640], 640, 256),
    ([1, W - 1, W, W + 1], [384, 300, 384, 17], 384, 128),
    ([5 * BS - 1, 20 * BS + 1], [1024, 1000], 1024, 256),
]


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
@pytest.mark.parametrize("heads", [(6, 1), (4, 2)], ids=["gqa6x1", "gqa4x2"])
@pytest.mark.parametrize("ctx_lens,query_lens,seq_len,q_tile", EDGE_CASES)
def test_tiles_equal_the_definition_at_tile_window_and_block_edges(ctx_lens, query_lens, seq_len, q_tile,
                                                                    heads, sliding):
    bias, ctx_slots = chunk_bias(ctx_lens, query_lens, seq_len, sliding)
    q, k, v = tensors(len(ctx_lens), *heads, seq_len, ctx_slots + seq_len, 16)
    scale = 16**-0.5
    want = definition(q, k, v, bias, scale)

    one = Recorder(scale)
    untiled = pa.prefill_attention(q, k, v, bias, one, q_tile=q_tile, ws_gib=0, window=W if sliding else None)
    assert len(one.calls) == 1  # BEAM_FSDPA_WS_GIB=0: one call, as vllm-gaudi does
    assert_rows_match(untiled, want, query_lens)

    tiles = Recorder(scale)
    ws_gib = bound_for(q_tile, q, k)  # one call would not fit; a q_tile tile does
    got = pa.prefill_attention(q, k, v, bias, tiles, q_tile=q_tile, ws_gib=ws_gib, window=W if sliding else None)
    assert_rows_match(got, want, query_lens)
    rows = [c[0][2] for c in tiles.calls]
    assert sum(rows) == seq_len and rows[:-1] == [q_tile] * (len(rows) - 1)
    for i, (_, (_, _, keys, _), _) in enumerate(tiles.calls):
        first, end = i * q_tile, min(seq_len, (i + 1) * q_tile)
        if sliding and first >= W - 1:  # past the first window: no context, no older chunk rows
            assert keys == end - first + W - 1
        else:  # causal: the context and the chunk up to the tile's last row
            assert keys == ctx_slots + end


def test_a_wrong_key_range_would_be_caught(monkeypatch):
    """The comparison bites: a tile that drops the oldest key of its first row's window differs."""
    ctx_lens, query_lens, seq_len = [W + 3], [768], 768
    bias, ctx_slots = chunk_bias(ctx_lens, query_lens, seq_len, sliding=True)
    q, k, v = tensors(1, 6, 1, seq_len, ctx_slots + seq_len, 16)
    want = definition(q, k, v, bias, 0.25)
    right = pa.tile_key_range

    def one_key_short(first, end, ctx_slots, window):
        k0, k1 = right(first, end, ctx_slots, window)
        return k0 + (k0 > 0), k1

    monkeypatch.setattr(pa, "tile_key_range", one_key_short)
    got = pa.prefill_attention(q, k, v, bias, pa.sdpa_kernel(0.25), q_tile=256, ws_gib=bound_for(256, q, k), window=W)
    assert not torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_a_4096_token_chunk_against_32k_of_context(sliding):
    ctx_lens, query_lens, seq_len = [32768], [4096], 4096
    bias, ctx_slots = chunk_bias(ctx_lens, query_lens, seq_len, sliding)
    q, k, v = tensors(1, 2, 1, seq_len, ctx_slots + seq_len, 8)
    want = definition(q, k, v, bias, 8**-0.5)
    tiles = Recorder(8**-0.5)
    # The 2 GiB default is not reached by 2 heads: a bound of 0.25 GiB (full layer) or of 1,024 rows
    # (the sliding layer's trimmed keys) makes the chunk too large for one call.
    ws_gib = min(0.25, bound_for(1024, q, k))
    got = pa.prefill_attention(q, k, v, bias, tiles, q_tile=1024, ws_gib=ws_gib, window=W if sliding else None)
    assert_rows_match(got, want, query_lens)
    assert len(tiles.calls) > 1
    for (_, _, rows, _), (_, _, keys, _), _ in tiles.calls[:-1]:
        assert rows % FSDPA_Q_TILE_STEP == 0 and rows <= 1024
        assert pa.workspace_bytes(1, 2, rows, keys) <= ws_gib * pa.GIB


def test_between_tiles_runs_between_tiles_only():
    bias, ctx_slots = chunk_bias([300], [512], 512, sliding=False)
    q, k, v = tensors(1, 6, 1, 512, ctx_slots + 512, 8)
    marks = []
    pa.prefill_attention(q, k, v, bias, pa.sdpa_kernel(0.3), q_tile=128, ws_gib=bound_for(128, q, k),
                         between_tiles=lambda: marks.append(1))
    assert len(marks) == 3
    marks.clear()  # where the whole chunk fits the bound: one call, nothing between
    pa.prefill_attention(q, k, v, bias, pa.sdpa_kernel(0.3), q_tile=128, ws_gib=2,
                         between_tiles=lambda: marks.append(1))
    assert marks == []


# ---------------------------------------------------------------- the workspace at the recipe's shapes

RECIPE = dict(q_heads=6, kv_heads=1, head_dim=128, chunk=4096)


def recipe_calls_on_meta(ctx_len, sliding, q_tile, ws_gib, chunk=RECIPE["chunk"]):
    """Run prefill_attention itself on meta tensors of the recipe's shapes: every call's shapes."""
    blocks = -(-ctx_len // BS)
    if sliding:
        blocks = min(blocks, win.window_block_count(W, BS))
    keys = blocks * BS + chunk
    q, k, v = tensors(1, RECIPE["q_heads"], RECIPE["kv_heads"], chunk, keys, RECIPE["head_dim"], device="meta")
    bias = torch.empty(1, 1, chunk, keys, device="meta", dtype=torch.bfloat16)
    rec = Recorder(1.0)
    out = pa.prefill_attention(q, k, v, bias, rec, q_tile=q_tile, ws_gib=ws_gib, window=W if sliding else None)
    assert out.shape == q.shape
    return [(qs[2], ks[2]) for qs, ks, _ in rec.calls]


@pytest.mark.parametrize("ctx_len", [16384, 65536, 131072, 262144], ids=["16K", "64K", "128K", "256K"])
@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_every_call_of_the_recipe_stays_under_the_bound(ctx_len, sliding):
    calls = recipe_calls_on_meta(ctx_len, sliding, q_tile=256, ws_gib=2)
    assert calls == pa.recipe_calls(ctx_len, sliding=sliding, q_tile=256, ws_gib=2)  # the table's source
    assert sum(r for r, _ in calls) == RECIPE["chunk"]
    for rows, keys in calls:
        assert pa.workspace_bytes(1, RECIPE["q_heads"], rows, keys) <= 2 * pa.GIB
        assert rows * keys * 2 < pa.BIAS_PLANE_LIMIT_BYTES
    (rows, keys), = recipe_calls_on_meta(ctx_len, sliding, q_tile=256, ws_gib=0)
    untiled = pa.workspace_bytes(1, RECIPE["q_heads"], rows, keys)
    assert (untiled > 2 * pa.GIB) is (not sliding)  # full layers need the tiles from 16K of context on


def test_every_prompt_bucket_with_context_of_the_recipe_stays_under_the_bound():
    from serving.lint_buckets import parse_bucket_text

    buckets, problems = parse_bucket_text((REPO / "serving/tp8-seqs16-256k.txt").read_text())
    with_context = [b for b in buckets if b.query > 1 and b.blocks > 0]
    assert not problems and len(with_context) > 100
    for bucket in with_context:
        for sliding in (False, True):
            calls = recipe_calls_on_meta(bucket.blocks * BS, sliding, q_tile=256, ws_gib=2, chunk=bucket.query)
            assert sum(r for r, _ in calls) == bucket.query
            assert all(pa.workspace_bytes(bucket.batch, 6, r, k) <= 2 * pa.GIB for r, k in calls), bucket


@pytest.mark.parametrize("ws_gib", [0.05, 0.5, 1, 2, 8, 48])
@pytest.mark.parametrize("q_tile", [0, 128, 256, 1024])
def test_the_tile_choice_keeps_the_bound_and_the_bucket_step(ws_gib, q_tile):
    chunk = RECIPE["chunk"]
    for ctx_len in (0, 16384, 262144, 1 << 20):
        keys = -(-ctx_len // BS) * BS + chunk

        def fits(rows):
            return pa.workspace_bytes(1, 6, rows, keys) <= ws_gib * pa.GIB and rows * keys * 2 < pa.BIAS_PLANE_LIMIT_BYTES

        rows = pa.tile_rows(chunk, keys, batch=1, q_heads=6, q_tile=q_tile, ws_gib=ws_gib)
        assert 1 <= rows <= chunk and fits(rows)
        if fits(chunk):  # one call wherever the untiled call fits: the stock call
            assert rows == chunk
        elif q_tile and fits(q_tile):
            assert rows == q_tile
        else:  # the fewest tiles: the most rows that fit, on the bucket step when one step fits
            fits_a_step = fits(FSDPA_Q_TILE_STEP)
            assert (rows % FSDPA_Q_TILE_STEP == 0) is fits_a_step
            assert not fits(rows + (FSDPA_Q_TILE_STEP if fits_a_step else 1))


def test_a_4096_token_chunk_is_one_call_up_to_the_bound_and_tiled_past_it():
    """At TP 8 (6 query heads, fp32 scores + bf16 bias: 26 bytes per query row and key) a 4,096-row
    call fits 2 GiB up to 2**31 / (4096 * 26) = 20,164 keys: 16,068 context tokens, 125 blocks of
    128 (16,000 slots). Up to there BEAM_FSDPA_Q_TILE=256 changes nothing; past it, 256-row tiles."""
    chunk, per_key_row = RECIPE["chunk"], 6 * 4 + 2
    last_block = (2 * pa.GIB // (chunk * per_key_row) - chunk) // BS
    assert last_block == 125
    for blocks, want in ((1, 1), (64, 1), (last_block, 1), (last_block + 1, 16), (2048, 16)):
        calls = recipe_calls_on_meta(blocks * BS, False, q_tile=256, ws_gib=2)
        assert len(calls) == want, (blocks, calls[:2])
        assert calls == pa.recipe_calls(blocks * BS, sliding=False, q_tile=256, ws_gib=2)
    # a sliding layer's context is trimmed to its window: one call at every context length
    assert all(len(recipe_calls_on_meta(ctx, True, q_tile=256, ws_gib=2)) == 1 for ctx in (4096, 262144))


@pytest.mark.parametrize("ctx_len", [1024, 12288, 32768])
def test_one_call_and_tiles_give_the_same_result(ctx_len):
    """The same chunk under a bound it fits (one call) and one it does not (tiles): equal rows."""
    ctx_lens, query_lens, seq_len = [ctx_len], [512], 512
    bias, ctx_slots = chunk_bias(ctx_lens, query_lens, seq_len, sliding=False)
    q, k, v = tensors(1, 2, 1, seq_len, ctx_slots + seq_len, 8)
    one, tiles = Recorder(8**-0.5), Recorder(8**-0.5)
    whole = pa.prefill_attention(q, k, v, bias, one, q_tile=128, ws_gib=bound_for(seq_len, q, k))
    tiled = pa.prefill_attention(q, k, v, bias, tiles, q_tile=128, ws_gib=bound_for(128, q, k))
    assert len(one.calls) == 1 and len(tiles.calls) == 4
    assert_rows_match(tiled, whole, query_lens)


def test_the_bias_plane_limit_holds_under_a_loose_bound():
    # 48 GiB would allow 1,024 rows over 1M keys; their bf16 plane (2 GiB) would return NaN.
    keys = (1 << 20) + 4096
    rows = pa.tile_rows(4096, keys, batch=1, q_heads=6, q_tile=1024, ws_gib=48)
    assert rows == 896 and rows * keys * 2 < pa.BIAS_PLANE_LIMIT_BYTES <= (rows + 128) * keys * 2


def test_a_bound_below_one_row_is_refused_naming_the_switch():
    with pytest.raises(ValueError, match="BEAM_FSDPA_WS_GIB=1e-06"):
        pa.tile_rows(4096, 266240, batch=1, q_heads=6, q_tile=256, ws_gib=1e-6)


def test_shapes_that_are_not_a_chunk_with_context_are_refused():
    q, k, v = tensors(1, 6, 1, 256, 200, 8)
    with pytest.raises(ValueError, match="not \\[B, Hq, S, D\\]"):
        pa.prefill_attention(q, k, v, torch.zeros(1, 1, 256, 200), pa.sdpa_kernel(1.0), q_tile=128, ws_gib=2)
    q, k, v = tensors(1, 6, 4, 256, 512, 8)
    with pytest.raises(ValueError, match="6 query heads are not a multiple of 4 KV heads"):
        pa.prefill_attention(q, k, v, torch.zeros(1, 1, 256, 512), pa.sdpa_kernel(1.0), q_tile=128, ws_gib=2)


def test_the_switches_are_read_through_the_switch_table():
    assert pa.fsdpa_tile_switches({}) == (256, 2.0)
    assert pa.fsdpa_tile_switches({"BEAM_FSDPA_Q_TILE": "512", "BEAM_FSDPA_WS_GIB": "0.5"}) == (512, 0.5)
    with pytest.raises(SwitchError, match="BEAM_FSDPA_Q_TILE"):
        pa.fsdpa_tile_switches({"BEAM_FSDPA_Q_TILE": "100"})


def test_the_table_prints_every_context():
    table = pa.workspace_table()
    for ctx in ("16K", "64K", "128K", "256K"):
        assert f"| {ctx} |" in table
    assert "26.41 GiB (4096 x 266240)" in table  # 6 heads x 4096 x 266240 x (4 + 2/6) bytes
