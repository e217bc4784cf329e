"""A MODEL (not a measurement) of what a window-sized KV cache costs and saves per step
at 256K context on the recipe's node, in benchmarks/decode_model.py's terms: bytes one card reads
in one step, KV read in whole blocks of 128, and the batch the KV pool lets run.

Every input is printed. The model's claims, each a count, not a timing:
- Decode, sliding layers: the blocks gathered per row are the window's, 5 at W = 512, with or
  without the window-sized cache: the port's beam-exact-window unit already hands sliding layers
  the exact window of the full-context table (stock vllm-gaudi: the last W // bs = 4 blocks). The
  window-sized cache takes the same 5 blocks from the sliding group's own table. Bytes saved per
  row: 0.
- Decode, sliding layers, as padded: vllm-gaudi pads every decode block list, the window lists
  too, to a decode bucket found from the list's own block count. The recipe's file
  (serving/tp8-seqs16-256k.txt) has no bucket below its 4K tier, so a sliding layer gathers 32
  blocks a row for its 5 (6.4x), with either cache; the window-KV file (`make_buckets --window-kv`)
  has a window tier of batch x 5 blocks, and the sliding groups' lists fill it exactly. That saving
  is the bucket file's, not the cache's (the full-context cache's window lists would fill the same
  tier); it is counted below per step.
- Prefill with cached context, sliding layers: FusedSDPA's prompt tiles see the window-trimmed
  context (at most 5 blocks, beam-exact-window's prefill_window_context) either way. Saved: 0.
- Full layers read the whole context either way (2,048 blocks at 256K).
- What it costs per step: the runner builds per-group metadata, 1 full + 5 sliding groups
  instead of one table: 5 more block tables [B, max blocks] to copy and 5 more slot mappings and
  window block lists (host work and host-to-device bytes, counted below; their time is not
  modelled).
- What it saves: memory. The pool (serving/kv_window.py) grows from 6,066 to 35,048 blocks, so the
  batch that fits at 256K grows from 2 to 16 sequences; the step then reads 8 times the KV bytes for
  8 times the tokens.

The card measurement that would confirm it: decode at 16 streams of 4K context with the window
cache on and off, both with the window-KV bucket file (everything else the recipe's): the model
says the KV bytes per step are equal, so a step-time difference beyond the run-to-run spread is
the per-group metadata cost; and with it on, vLLM's startup log must report the pool as vLLM
counts it: "KV cache size: N tokens, Maximum concurrency for 262,144 tokens per request: C x",
where C divides the blocks by what vLLM's pool sizer reserves a request at max-model-len (2,048
full blocks plus, in each sliding group, SlidingWindowSpec.max_admission_blocks_per_request: 69
blocks at async scheduling's 2 x 4,096 in-flight tokens), so C is below 16 although 16 decoding
sequences at 256K hold only 5 blocks a sliding group (printed below); C is vLLM's sizing figure,
not its admission rule (its manager allocates the blocks a step needs and frees those the window
left: tests/serving/test_kv_window.py holds 16 sequences at 256K in vLLM's own manager).

Run: python benchmarks/window_kv_model.py [--context 262144] [--bandwidth-tbs 2.46]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from beam_hpu.runtime.sliding_window.hpu_window import prefill_window_context_blocks, window_block_count  # noqa: E402
from serving import kv_window as kvw  # noqa: E402

GB = 1e9
TABLE_ENTRY_BYTES = 4  # int32 block ids


def stock_window_blocks(window: int, block_size: int) -> int:
    """vllm-gaudi's block-granular decode window (non-gpt_oss): the last W // bs blocks."""
    return window // block_size


def per_row_kv_blocks(context: int, window: int, block_size: int) -> dict[str, int]:
    """Blocks one decode row gathers per layer kind at `context` tokens (query at `context`)."""
    return {
        "full layer": context // block_size + 1,
        "sliding layer, stock vllm-gaudi": min(stock_window_blocks(window, block_size), context // block_size + 1),
        "sliding layer, beam-exact-window (full-context cache)": min(window_block_count(window, block_size),
                                                                      context // block_size + 1),
        "sliding layer, window-sized cache": min(window_block_count(window, block_size), context // block_size + 1),
    }


def landing_bucket_blocks(bucket_file: str, batch: int, blocks: int) -> int:
    """The blocks of the decode bucket vllm-gaudi's lookup (find_decode_bucket: the first bucket,
    in sorted order, with at least the batch and the blocks) pads a `blocks`-long list to."""
    shapes = sorted((b, c) for b, c in kvw.recipe_decode_buckets(bucket_file))
    return next(c for b, c in shapes if b >= batch and c >= blocks)


def vllm_logged_pool(num_blocks: int, num_sliding_groups: int, in_flight_tokens: int,
                     max_model_len: int = kvw.MAX_MODEL_LEN) -> tuple[int, float]:
    """(tokens, concurrency) vLLM's startup log reports (get_kv_cache_capacity): the blocks over
    what its pool sizer reserves one request at max_model_len in every group, by vLLM's own
    specs' max_memory_usage_bytes."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from beam_hpu.runtime.window_kv.groups import window_kv_spec

    full = FullAttentionSpec(block_size=kvw.BLOCK_SIZE, num_kv_heads=1, head_size=kvw.HEAD_DIM, dtype=torch.bfloat16)
    sliding = window_kv_spec(full, kvw.SLIDING_WINDOW)
    config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_model_len),
                             parallel_config=SimpleNamespace(decode_context_parallel_size=1),
                             max_in_flight_tokens=in_flight_tokens)
    per_request = sum(-(-spec.max_memory_usage_bytes(config) // spec.page_size_bytes) * count
                      for spec, count in ((full, 1), (sliding, num_sliding_groups)))
    concurrency = num_blocks / per_request
    return int(concurrency * max_model_len), concurrency


def step_kv_bytes(batch: int, context: int, window: int, block_size: int, num_full: int, num_sliding: int) -> float:
    """bf16 K and V one card reads in one decode step, whole blocks."""
    rows = per_row_kv_blocks(context, window, block_size)
    blocks = num_full * rows["full layer"] + num_sliding * rows["sliding layer, window-sized cache"]
    return batch * blocks * kvw.page_bytes(2, block_size)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=kvw.MAX_MODEL_LEN - 1, help="tokens in each sequence's KV")
    p.add_argument("--bandwidth-tbs", type=float, default=2.46, help="HBM bandwidth (Gaudi 2 published: 2.46)")
    a = p.parse_args(argv)
    bs, w = kvw.BLOCK_SIZE, kvw.SLIDING_WINDOW
    nf, ns = kvw.NUM_FULL_LAYERS, kvw.NUM_LAYERS - kvw.NUM_FULL_LAYERS
    layout = kvw.hybrid_layout(nf, ns)
    pools = {pool.name: pool for pool in kvw.pools(kvw.kv_bytes_per_card())}
    sw = kvw.decode_sliding_blocks()

    print("MODEL, not a measurement. Inputs:")
    print(f"  Beam: {kvw.NUM_LAYERS} layers ({nf} full, {ns} sliding, window {w}); {kvw.KV_HEADS_PER_CARD} KV head x "
          f"{kvw.HEAD_DIM} per card (TP 8); bf16 KV; block {bs}; context {a.context:,} tokens per sequence")
    print(f"  KV page (one layer, one block, K+V, one card): {kvw.page_bytes(2):,} B; KV pool from the recipe's "
          f"measured {kvw.RECIPE_POOL_TOKENS:,} tokens; HBM {a.bandwidth_tbs} TB/s (a bound, not a step time)")
    print(f"  window layout (vLLM's grouping): {layout.full_groups} full + {layout.sliding_groups} sliding groups of "
          f"{layout.group_size}")
    print()
    print("Blocks gathered per decode row per layer:")
    for kind, n in per_row_kv_blocks(a.context, w, bs).items():
        print(f"  {kind:55s} {n:6,}")
    ctx_blocks = len(prefill_window_context_blocks(a.context, w, bs))
    print(f"Prefill chunk at {a.context:,} tokens of context, FusedSDPA tile context per sliding layer: {ctx_blocks} "
          f"blocks with beam-exact-window, with or without the window cache (full layers: {-(-a.context // bs):,})")
    print()
    print("Per-step metadata (host side) for B decode rows, tables as wide as the longest context:")
    width = -(-kvw.MAX_MODEL_LEN // bs)
    for batch in (1, 16):
        one, groups = batch * width * TABLE_ENTRY_BYTES, layout.full_groups + layout.sliding_groups
        print(f"  B = {batch:2d}: block tables {one:,} B today -> {one * groups:,} B ({groups} groups); slot mappings"
              f" and window lists x {groups} (time not modelled)")
    print()
    print("Batch that fits at this context, and the KV it reads per step:")
    for name in ("bf16 full", "bf16 window"):
        pool = pools[name]
        per_seq = pool.blocks_per_sequence(a.context + 1, sw)
        batch = min(kvw.MAX_NUM_SEQS, pool.usable_blocks // per_seq)
        kv = step_kv_bytes(batch, a.context, w, bs, nf, ns)
        print(f"  {name:12s}: pool {pool.num_blocks:,} blocks, {per_seq:,} per sequence -> batch {batch:2d}; KV per "
              f"step {kv / GB:6.2f} GB per card, >= {kv / (a.bandwidth_tbs * 1e12) * 1e3:5.2f} ms at the bandwidth "
              f"bound ({kv / GB / max(batch, 1):.3f} GB per sequence: the same in both)")
    print()
    print("Sliding layers' decode block lists as padded to a decode bucket (at most 5 blocks a row), per step:")
    page = kvw.page_bytes(2, bs)
    for batch in (1, 16):
        need = batch * sw
        recipe = landing_bucket_blocks("tp8-seqs16-256k.txt", batch, need)
        window = landing_bucket_blocks("tp8-seqs16-256k-window.txt", batch, need)
        saved = ns * (recipe - window) * page
        print(f"  B = {batch:2d}: recipe's file pads {need} blocks to {recipe} ({recipe // batch} a row), the window-KV "
              f"file to {window} ({window // batch} a row): {ns} layers x {recipe - window:,} blocks = "
              f"{saved / GB:.3f} GB per card per step less, >= {saved / (a.bandwidth_tbs * 1e12) * 1e3:.2f} ms at the "
              "bandwidth bound (either cache)")
    print()
    window_pool = pools["bf16 window"]
    for batches, why in ((2, "async scheduling, the recipe"), (1, "no async scheduling, the speculative variant")):
        tokens, concurrency = vllm_logged_pool(window_pool.num_blocks, layout.sliding_groups,
                                               batches * kvw.MAX_NUM_BATCHED_TOKENS)
        print(f"vLLM's startup log with the window cache ({why}): KV cache size {tokens:,} tokens, maximum "
              f"concurrency {concurrency:.2f}x at {kvw.MAX_MODEL_LEN:,} (pool {window_pool.num_blocks:,} blocks)")
    print()
    print("Confirm on a card: 16-stream decode at 4K context, window cache on vs off, both with the window-KV bucket")
    print("file: equal KV bytes per step (model), so a step-time difference beyond the run-to-run spread is the")
    print("per-group metadata; with it on, the startup log reports the figures above.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
