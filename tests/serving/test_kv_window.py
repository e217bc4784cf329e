"""serving/kv_window.py against vLLM: its grouping and block counts are vLLM's own, and vLLM's
KV-cache manager, given the window pool's blocks, holds 16 sequences of 256K tokens at once where
the full-context pool holds two."""

from __future__ import annotations

import pytest
import torch

from beam_hpu.runtime.sliding_window import hpu_window as win
from beam_hpu.runtime.window_kv import groups as wkv
from serving import kv_window as kvw

pytest.importorskip("vllm")
from vllm.config import VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402


def vllm_kv_config(num_full: int, num_sliding: int, kv_bytes: int, dtype, window: bool):
    full = FullAttentionSpec(block_size=kvw.BLOCK_SIZE, num_kv_heads=kvw.KV_HEADS_PER_CARD,
                             head_size=kvw.HEAD_DIM, dtype=dtype)
    kinds = [None] * num_full + [kvw.SLIDING_WINDOW] * num_sliding
    specs = {f"layers.{i}": wkv.window_kv_spec(full, w if window else None) for i, w in enumerate(kinds)}
    config = VllmConfig()
    config.cache_config.kv_cache_layout = "LBHNC"
    groups = get_kv_cache_groups(config, specs)
    return get_kv_cache_config_from_groups(config, groups, kv_bytes)


@pytest.mark.parametrize("num_full,num_sliding", [(9, 43), (1, 5), (12, 13), (13, 12), (3, 3), (10, 20), (5, 1)])
def test_hybrid_layout_is_vllms_grouping(num_full, num_sliding):
    kc = vllm_kv_config(num_full, num_sliding, 10**9, torch.bfloat16, window=True)
    sizes = {len(g.layer_names) for g in kc.kv_cache_groups}
    kinds = [type(g.kv_cache_spec).__name__ for g in kc.kv_cache_groups]
    layout = kvw.hybrid_layout(num_full, num_sliding)
    assert max(sizes) == layout.group_size
    assert kinds.count("FullAttentionSpec") == layout.full_groups
    assert kinds.count("SlidingWindowSpec") == layout.sliding_groups


def test_pool_blocks_are_vllms():
    kv_bytes = kvw.kv_bytes_per_card()
    ours = {p.name: p.num_blocks for p in kvw.pools(kv_bytes)}
    for name, dtype, window in (("bf16 full", torch.bfloat16, False), ("FP8 full", torch.float8_e4m3fn, False),
                                ("bf16 window", torch.bfloat16, True), ("FP8 window", torch.float8_e4m3fn, True)):
        kc = vllm_kv_config(kvw.NUM_FULL_LAYERS, kvw.NUM_LAYERS - kvw.NUM_FULL_LAYERS, kv_bytes, dtype, window)
        assert ours[name] == kc.num_blocks, name
    # The recipe's pool comes back for today's layout.
    assert ours["bf16 full"] * kvw.BLOCK_SIZE == kvw.RECIPE_POOL_TOKENS


def test_window_pool_is_over_five_times_and_holds_sixteen_256k_sequences():
    pools = {p.name: p for p in kvw.pools(kvw.kv_bytes_per_card())}
    sw = kvw.decode_sliding_blocks()
    assert sw == win.window_block_count(kvw.SLIDING_WINDOW, kvw.BLOCK_SIZE) == 5
    base = pools["bf16 full"].context_tokens(16, sw)
    assert pools["bf16 window"].context_tokens(16, sw) >= 5 * base
    assert pools["bf16 window"].longest_context(16, sw, kvw.prefill_reserve(5)) >= kvw.MAX_MODEL_LEN
    assert pools["bf16 full"].longest_context(16, sw) == 48_512
    assert kvw.prefill_reserve(5) == 5 * (wkv.sliding_blocks_bound(512, 128, 4096) - sw)
    assert "| bf16 window | 35,048 | 4,434,816 | 5.71 |" in kvw.report()


def fill(num_blocks: int, window: bool, num_seqs: int = 16, context: int = kvw.MAX_MODEL_LEN) -> int:
    """How many of `num_seqs` sequences of `context` tokens vLLM's manager admits and prefills
    (chunks of max-num-batched-tokens, one sequence after the other, each decoding once after its
    prefill as the scheduler runs it in the next step), then decodes one more token each.

    The decode step matters: a sliding group frees what the window has left only when the next
    step allocates, so right after its last chunk a sequence still holds that chunk's blocks
    (36 per sliding group here, 5 after one decode)."""
    kc = vllm_kv_config(kvw.NUM_FULL_LAYERS, kvw.NUM_LAYERS - kvw.NUM_FULL_LAYERS,
                        num_blocks * (9 if window else 52) * kvw.page_bytes(2), torch.bfloat16, window)
    assert kc.num_blocks == num_blocks
    # max_model_len: room for the two decode tokens
    manager = KVCacheManager(kc, max_model_len=context + 8, scheduler_block_size=kvw.BLOCK_SIZE,
                             hash_block_size=kvw.BLOCK_SIZE, enable_caching=False)
    held = []
    for s in range(num_seqs):
        req = Request(f"s{s}", [1] * context, SamplingParams(max_tokens=4), None)
        ok = True
        while req.num_computed_tokens < context:
            chunk = min(kvw.MAX_NUM_BATCHED_TOKENS, context - req.num_computed_tokens)
            if manager.allocate_slots(req, chunk) is None:
                ok = False
                break
            req.num_computed_tokens += chunk
        if not ok:
            manager.free(req)
            break
        req.append_output_token_ids(2)
        assert manager.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        req.append_output_token_ids(2)
        held.append(req)
    for req in held:  # every admitted sequence still decodes
        assert manager.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    return len(held)


def test_vllms_manager_holds_sixteen_256k_sequences_in_the_window_pool():
    pools = {p.name: p for p in kvw.pools(kvw.kv_bytes_per_card())}
    assert fill(pools["bf16 window"].num_blocks, window=True) == 16
    assert fill(pools["bf16 full"].num_blocks, window=False) == 2


def test_decode_buckets_the_window_pool_makes_reachable():
    from serving.lint_buckets import lint_bucket_text
    from serving.recipe import SERVING_DIR, load_recipe, recipe_geometry

    pools = {p.name: p for p in kvw.pools(kvw.kv_bytes_per_card())}
    decode = kvw.recipe_decode_buckets()
    assert kvw.unreachable_decode_buckets(pools["bf16 full"], decode, 5) == [(4, 8192), (8, 16384), (16, 8192),
                                                                             (16, 32768)]
    assert kvw.unreachable_decode_buckets(pools["bf16 window"], decode, 5) == []
    # The 128K tier make_buckets leaves out from batch 8 (today's pool cannot hold it): under the
    # window pool it is reachable, and the linter accepts the file with it (25 decode graphs).
    assert kvw.unreachable_decode_buckets(pools["bf16 window"], [(8, 8192), (16, 16384)], 5) == []
    text = (SERVING_DIR / "tp8-seqs16-256k.txt").read_text() + "(8, 1, 8192)\n(16, 1, 16384)\n"
    geometry = recipe_geometry(load_recipe())
    assert lint_bucket_text(text, geometry) == []
    assert lint_bucket_text(text + "(16, 1, 12288)\n", geometry) == [
        "decode: 26 buckets, each a captured graph; the limit is 25"]
