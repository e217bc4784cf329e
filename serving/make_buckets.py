"""Generate the recipe's bucket file (VLLM_BUCKETING_FROM_FILE) from the launch geometry.

Prompt buckets: what vllm-gaudi's default exponential strategy would build for these flags
(query lengths up to --max-num-batched-tokens, context blocks spaced exponentially, and for the
largest context the most that still fits next to each query length), plus one top point: a full
chunk over ceil((max_model_len - 1) / block_size) context blocks. vllm-gaudi's own largest
context per query rounds down, so a short last chunk of a 256K prompt would miss every bucket
and compile a fallback graph mid-serving; the top point covers every chunk.

Decode buckets: coarse on purpose. Each captured decode graph holds device memory, and
vllm-gaudi's own decode buckets for these flags number 93; here batch 1, 2, 4, 8 and 16 get one
bucket per context tier (4K, 16K, 64K, 128K and 256K tokens per sequence), without the 128K tier
from batch 8 on: eight 128K sequences already exceed the 776,448-token KV pool, so only batches
sharing a prefix reach it, and they fall to the 256K tier.

The speculative variant (serving/launch-speculative.sh, `--speculative`) gets a file of its own:
vllm-gaudi turns each decode bucket of the file into up to three graphs under speculation (the
bucket, and batch x (k+1) verify rows at the same and at (k+1) times the blocks), so the
recipe's 23 become 69. Its file keeps the prompt buckets and seeds decode with batch 1, 4 and 16
only, at 4K and 256K per sequence for batch 1 and 4K, 64K and 256K for batch 4 and 16: 8 seeds,
at most 24 graphs for any k. Each batch keeps its 4K tier because the sliding-window block list
(5 blocks a row) is padded to a decode bucket too, in 43 of the 52 layers. Batches 2, 3 pad to 4
rows, 5 to 15 to 16 (vllm-gaudi's spec buckets of batch 1 serve plain decode steps of 5
sequences); `python -m serving.decode_padding` prints what each file pads.

The window-KV variants (`--window-kv`, for BEAM_WINDOW_KV=1: a window-sized KV cache for the 43
sliding layers) re-derive the decode block ranges for per-group block lists: vllm-gaudi
pads each KV-cache group's decode block list to a decode bucket found from that group's own block
count, and a sliding group holds at most window_block_count blocks a row (5 at window 512, block
128), so its lists land on each batch's smallest bucket. Here that smallest bucket is the window
tier itself (batch x 5 blocks) instead of the 4K tier (batch x 32), which would make 43 layers
gather 32 blocks a row for a window of 5; the full group keeps the recipe's ranges from 16K up,
and the 128K tier returns from batch 8 on (the window pool holds 16 sequences at 256K:
python -m serving.kv_window). Full-group steps under 640 tokens a row use the window tier, those
from 640 to 16K the 16K tier. The same graph count as the recipe's (25; the speculative variant
24): each graph's sliding lists always fill its batch's window tier, so they add no graph.

Usage (from the repository root):
    python -m serving.make_buckets            # rewrite serving/<buckets.file from recipe.yaml>
    python -m serving.make_buckets --check    # exit 1 if the committed file differs
    python -m serving.make_buckets --speculative [--check]   # the same for speculative.buckets.file
    python -m serving.make_buckets --window-kv [--speculative] [--check]   # the window-KV variant of either
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from beam_hpu.runtime.sliding_window.hpu_window import window_block_count
from serving.recipe import SERVING_DIR, Geometry, load_recipe, recipe_geometry

# vllm-gaudi treats a prompt context as long from this many tokens of --max-model-len on, and then
# gives the largest context bucket of each query length its own edge value.
LONG_CONTEXT_TOKENS = 8192
DECODE_BATCHES = (1, 2, 4, 8, 16)
DECODE_TIERS_TOKENS = (4096, 16384, 65536, 131072, 262144)
# From this batch size on, the 128K tier is left out (see the module docstring).
DECODE_SKIP_128K_FROM_BATCH = 8
# Decode seeds of the speculative variant: batch -> tokens per sequence of each tier.
SPECULATIVE_DECODE_TIERS = {1: (4096, 262144), 4: (4096, 65536, 262144), 16: (4096, 65536, 262144)}


def exponential_points(low: int, step: int, high: int, count: int) -> list[int]:
    """`count` points from `low` to `high` at a constant ratio, each rounded up to a multiple of
    `step`, duplicates dropped: vllm-gaudi's exponential bucket spacing. A `low` of 0 or 1 is kept
    as its own point and the ratio starts from `step` instead."""
    if count <= 1:
        return [high]
    start = step if low in (0, 1) else low
    points = set()
    for i in range(count):
        # The exponent is computed as (1/(count-1))*i, not i/(count-1): rounding up a value that
        # lands a hair above a multiple of `step` would otherwise give a different bucket.
        value = start * math.pow(high / start, (1.0 / float(count - 1)) * i)
        points.add(math.ceil(value / step) * step)
    if low in (0, 1):
        points.add(low)
    ordered = sorted(points)
    ordered[-1] = min(ordered[-1], high)
    return ordered


def prompt_buckets(g: Geometry) -> list[tuple[int, int, int]]:
    """(batch, query tokens, context blocks) vllm-gaudi's exponential strategy builds, plus the
    top point."""
    long_context = g.max_model_len >= LONG_CONTEXT_TOKENS
    batches = exponential_points(1, 2, g.max_prefill_batch_size, math.ceil(math.log2(g.max_prefill_batch_size)) + 1)
    queries = exponential_points(
        g.block_size, g.block_size, g.max_num_batched_tokens, math.ceil(math.log2(g.max_num_batched_tokens))
    )
    reserved = g.max_num_batched_tokens if long_context else g.block_size
    top_ctx = max(1, (g.max_model_len - reserved) // g.block_size)
    contexts = exponential_points(0, 1, top_ctx, 2 if top_ctx == 1 else math.ceil(math.log2(top_ctx)) + 1)
    max_ctx_blocks = math.ceil((g.max_model_len - 1) / g.block_size)

    buckets = set()
    for batch in batches:
        for ctx in contexts:
            for query in queries:
                edge = ctx
                if long_context and ctx == contexts[-1]:
                    edge = (g.max_model_len - query) // g.block_size
                if edge <= max_ctx_blocks and query <= g.max_model_len and batch * query <= g.max_num_batched_tokens:
                    buckets.add((batch, query, edge))
    buckets.add((1, min(g.max_num_batched_tokens, g.max_model_len), max_ctx_blocks))
    return sorted(buckets)


def recipe_decode_tiers() -> dict[int, tuple[int, ...]]:
    """Batch -> tokens per sequence of each decode tier of the recipe's file."""
    return {batch: tuple(t for t in DECODE_TIERS_TOKENS if not (t == 131072 and batch >= DECODE_SKIP_128K_FROM_BATCH))
            for batch in DECODE_BATCHES}


def window_kv_decode_tiers(g: Geometry, speculative: bool = False) -> dict[int, tuple[int, ...]]:
    """Batch -> tokens per sequence of each decode tier under a window-sized KV cache: the recipe's
    tiers (the speculative variant's seeds) with every tier (the 128K one too), the 4K tier
    replaced by the window tier, window_block_count blocks a sequence."""
    window_tokens = window_block_count(g.sliding_window, g.block_size) * g.block_size
    base = SPECULATIVE_DECODE_TIERS if speculative else {b: DECODE_TIERS_TOKENS for b in DECODE_BATCHES}
    return {batch: (window_tokens, ) + tuple(t for t in tiers if t > DECODE_TIERS_TOKENS[0])
            for batch, tiers in base.items()}


def window_kv_file_name(file_name: str) -> str:
    """tp8-seqs16-256k.txt -> tp8-seqs16-256k-window.txt."""
    stem, dot, ext = file_name.rpartition(".")
    return f"{stem}-window{dot}{ext}"


def decode_buckets(g: Geometry, tiers: dict[int, tuple[int, ...]] | None = None) -> list[tuple[int, int, int]]:
    """(batch, 1, total KV blocks of the padded batch) for each batch and its tiers (tokens per
    sequence; default the recipe's)."""
    buckets = []
    for batch, batch_tiers in (tiers or recipe_decode_tiers()).items():
        if batch > g.max_num_seqs:
            continue
        for tier in batch_tiers:
            blocks_per_seq = math.ceil(min(tier, g.max_model_len) / g.block_size)
            buckets.append((batch, 1, batch * blocks_per_seq))
    return sorted(set(buckets))


def _grouped(buckets, key_len: int):
    """One line per (batch, query) with the list of its third elements."""
    rows: dict[tuple, list[int]] = {}
    for bucket in buckets:
        rows.setdefault(bucket[:key_len], []).append(bucket[key_len])
    return rows


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n}"


def render(g: Geometry, file_name: str, speculative: bool = False, window_kv: bool = False) -> str:
    command = ("python -m serving.make_buckets" + (" --speculative" if speculative else "")
               + (" --window-kv" if window_kv else ""))
    variant = ", ".join(([] if not speculative else ["speculative"]) + ([] if not window_kv else ["window-KV"]))
    lines = [
        f"# {file_name}: vllm-gaudi bucket file (VLLM_BUCKETING_FROM_FILE) for Beam-1.0 on 8x Gaudi 2"
        + (f", {variant} variant." if variant else "."),
        f"# Generated by `{command}` from serving/recipe.yaml; do not edit by hand.",
        f"# --block-size {g.block_size} --max-model-len {g.max_model_len} --max-num-seqs {g.max_num_seqs}"
        f" --max-num-batched-tokens {g.max_num_batched_tokens}",
        "# Each line is (batch, query tokens, blocks); lists expand to their Cartesian product.",
        "",
        "# Prompt: (batch, query tokens, context blocks); vllm-gaudi's exponential buckets",
    ]
    prompts = prompt_buckets(g)
    top = prompts[-1]
    for (batch, query), contexts in _grouped([b for b in prompts if b != top], 2).items():
        lines.append(f"({batch}, {query}, {contexts})")
    lines.append(f"# Top point: a full chunk over {top[2] * g.block_size:,} tokens of context")
    lines.append(f"{top}")
    lines += ["", "# Decode: (batch, 1, total KV blocks of the batch)"]
    if window_kv:
        lines += ["# Window KV (BEAM_WINDOW_KV=1): each KV-cache group's block list is bucketed on its own; the",
                  f"# sliding groups' ({window_block_count(g.sliding_window, g.block_size)} blocks a row at most)"
                  " fill each batch's smallest bucket, its window tier"]
    if speculative:
        lines += ["# Seeds: with k drafts vllm-gaudi adds (batch x (k+1), 1, blocks) when batch x (k+1) <= blocks and",
                  "# (batch x (k+1), 1, blocks x (k+1)), both capped at every row at --max-model-len"]
    tiers = window_kv_decode_tiers(g, speculative) if window_kv else (SPECULATIVE_DECODE_TIERS if speculative else None)
    for (batch, _), blocks in _grouped(decode_buckets(g, tiers), 2).items():
        tokens = ", ".join(_tokens(b * g.block_size // batch) for b in blocks)
        lines.append(f"({batch}, 1, {blocks})  # per sequence: {tokens}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=SERVING_DIR / "recipe.yaml")
    parser.add_argument("--out", type=Path, help="default: serving/<buckets.file of the recipe>")
    parser.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    parser.add_argument("--speculative", action="store_true",
                        help="the speculative variant's file (default out: serving/<speculative.buckets.file>)")
    parser.add_argument("--window-kv", action="store_true",
                        help="the window-KV variant (BEAM_WINDOW_KV=1) of the file (default out: <file>-window.txt)")
    args = parser.parse_args(argv)

    recipe = load_recipe(args.recipe)
    section = recipe["speculative"] if args.speculative else recipe
    name = section["buckets"]["file"]
    out = args.out or SERVING_DIR / (window_kv_file_name(name) if args.window_kv else name)
    text = render(recipe_geometry(recipe), out.name, args.speculative, args.window_kv)
    if args.check:
        if not out.exists() or out.read_text() != text:
            command = ("python -m serving.make_buckets" + (" --speculative" if args.speculative else "")
                       + (" --window-kv" if args.window_kv else ""))
            print(f"{out} differs from what `{command}` generates", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
