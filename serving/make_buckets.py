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

The DFlash2 variant (serving/launch-dflash2.sh, `--dflash2`) verifies 7 drafts a step (block 8),
and the port's DFlash2 proposer captures one drafter block graph per padded batch on top of
vllm-gaudi's graphs: the speculative file's 8 seeds would give 24 + 4 = 28. Its file keeps the
prompt buckets and seeds decode with batch 1 at 4K, 64K and 256K, batch 4 at 4K and 64K and batch
16 at 4K and 256K: 21 graphs at k = 7 and 4 drafter graphs (batches 1, 4, 8, 16), 25. Batch 1
(where drafts pay most) keeps every tier; what the others give up is in the file's header. The
file is made for its k only, and its header says so (the startup guard reads it).

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
    python -m serving.make_buckets --dflash2 [--check]       # the same for dflash2.buckets.file
    python -m serving.make_buckets --window-kv [--speculative] [--check]   # the window-KV variant of either
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from beam_hpu.runtime.sliding_window.hpu_window import window_block_count
from beam_hpu.settings.guards import bucket_file_drafts_line
from serving.lint_buckets import (drafter_block_batches, drafts_in_block_graphs, speculative_decode_buckets,
                                  speculative_tokens)
from serving.recipe import SERVING_DIR, Geometry, load_recipe, recipe_geometry, window_kv_file_name

# vllm-gaudi treats a prompt context as long from this many tokens of --max-model-len on, and then
# gives the largest context bucket of each query length its own edge value.
LONG_CONTEXT_TOKENS = 8192
DECODE_BATCHES = (1, 2, 4, 8, 16)
DECODE_TIERS_TOKENS = (4096, 16384, 65536, 131072, 262144)
# From this batch size on, the 128K tier is left out (see the module docstring).
DECODE_SKIP_128K_FROM_BATCH = 8
# Decode seeds of the speculative variant: batch -> tokens per sequence of each tier.
SPECULATIVE_DECODE_TIERS = {1: (4096, 262144), 4: (4096, 65536, 262144), 16: (4096, 65536, 262144)}
# Decode seeds of the DFlash2 variant (7 drafts, and a drafter block graph per padded batch).
DFLASH2_DECODE_TIERS = {1: (4096, 65536, 262144), 4: (4096, 65536), 16: (4096, 262144)}
# recipe.yaml section -> its decode seeds.
VARIANT_DECODE_TIERS = {"speculative": SPECULATIVE_DECODE_TIERS, "dflash2": DFLASH2_DECODE_TIERS}
# What the DFlash2 file gives up against the speculative file's seeds, as serving/decode_padding.py
# prints it for both at k = 7 (verify steps: rows and blocks over the step's own).
DFLASH2_GIVES_UP = [
    "Against the speculative file's seeds it drops batch 4's 256K and batch 16's 64K tiers (a seed is 3",
    "graphs): verify steps of 2 to 4 sequences past 64K run as 16 (128 rows, 4x to 8x their own), verify",
    "steps of 2 to 16 sequences from 16K on pad up to 8x their blocks (there 4x), plain steps of 9 to 16",
    "up to 21x (there 5.3x). Batch 1 gains its 64K tier (verify steps at most 4x their blocks, there 8x),",
    "and the graphs hold 731 rows (there 1054). `python -m serving.decode_padding` prints both files.",
]


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


def window_kv_decode_tiers(g: Geometry, variant: str | None = None) -> dict[int, tuple[int, ...]]:
    """Batch -> tokens per sequence of each decode tier under a window-sized KV cache: the recipe's
    tiers (a variant's seeds) with every tier (the 128K one too), the 4K tier replaced by the window
    tier, window_block_count blocks a sequence."""
    window_tokens = window_block_count(g.sliding_window, g.block_size) * g.block_size
    base = VARIANT_DECODE_TIERS[variant] if variant else {b: DECODE_TIERS_TOKENS for b in DECODE_BATCHES}
    return {batch: (window_tokens, ) + tuple(t for t in tiers if t > DECODE_TIERS_TOKENS[0])
            for batch, tiers in base.items()}


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


VARIANT_TITLES = {"speculative": "speculative", "dflash2": "DFlash2"}


def command_line(variant: str | None, window_kv: bool) -> str:
    return "python -m serving.make_buckets" + (f" --{variant}" if variant else "") + (" --window-kv" if window_kv else "")


def render(g: Geometry, file_name: str, variant: str | None = None, window_kv: bool = False,
           drafter_k: int = 0) -> str:
    """The bucket file's text; `variant` a recipe.yaml section with drafts (its decode seeds),
    `drafter_k` the drafts a variant with drafter block graphs is made for (recorded in the header
    and counted)."""
    title = ", ".join(([VARIANT_TITLES[variant]] if variant else []) + (["window-KV"] if window_kv else []))
    lines = [
        f"# {file_name}: vllm-gaudi bucket file (VLLM_BUCKETING_FROM_FILE) for Beam-1.0 on 8x Gaudi 2"
        + (f", {title} variant." if title else "."),
        f"# Generated by `{command_line(variant, window_kv)}` from serving/recipe.yaml; do not edit by hand.",
        f"# --block-size {g.block_size} --max-model-len {g.max_model_len} --max-num-seqs {g.max_num_seqs}"
        f" --max-num-batched-tokens {g.max_num_batched_tokens}",
    ]
    if drafter_k:
        lines.append(bucket_file_drafts_line(drafter_k)
                     + " (its graph count holds at that k; the startup guard refuses method dflash at another)")
    lines += [
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
    if variant:
        lines += ["# Seeds: with k drafts vllm-gaudi adds (batch x (k+1), 1, blocks) when batch x (k+1) <= blocks and",
                  "# (batch x (k+1), 1, blocks x (k+1)), both capped at every row at --max-model-len"]
    tiers = window_kv_decode_tiers(g, variant) if window_kv else (VARIANT_DECODE_TIERS[variant] if variant else None)
    seeds = decode_buckets(g, tiers)
    if drafter_k:
        prepared = speculative_decode_buckets(seeds, drafter_k, g)
        drafter = sorted(drafter_block_batches(seeds, prepared, g))
        lines += [f"# At k = {drafter_k}: {len(prepared)} decode graphs and {len(drafter)} drafter block graphs (one per"
                  f" padded batch: {', '.join(map(str, drafter))}),",
                  f"# {len(prepared) + len(drafter)} captured graphs; the limit is {g.max_decode_graphs}"
                  " (`python -m serving.lint_buckets --dflash2`)."]
        lines += [f"# {line}" for line in DFLASH2_GIVES_UP]
    for (batch, _), blocks in _grouped(seeds, 2).items():
        tokens = ", ".join(_tokens(b * g.block_size // batch) for b in blocks)
        lines.append(f"({batch}, 1, {blocks})  # per sequence: {tokens}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=SERVING_DIR / "recipe.yaml")
    parser.add_argument("--out", type=Path, help="default: serving/<buckets.file of the recipe>")
    parser.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    variants = parser.add_mutually_exclusive_group()
    variants.add_argument("--speculative", dest="variant", action="store_const", const="speculative",
                          help="the speculative variant's file (default out: serving/<speculative.buckets.file>)")
    variants.add_argument("--dflash2", dest="variant", action="store_const", const="dflash2",
                          help="the DFlash2 variant's file (default out: serving/<dflash2.buckets.file>)")
    parser.add_argument("--window-kv", action="store_true",
                        help="the window-KV variant (BEAM_WINDOW_KV=1) of the file (default out: <file>-window.txt)")
    args = parser.parse_args(argv)

    recipe = load_recipe(args.recipe)
    drafter_k = 0
    if args.variant and drafts_in_block_graphs(recipe, args.variant):
        if args.window_kv:
            # Its window tier would change the drafter's padded batches and the count: not derived yet.
            parser.error(f"--window-kv has no file for the {args.variant} variant")
        drafter_k = speculative_tokens(recipe, args.variant)
    section = recipe[args.variant] if args.variant else recipe
    name = section["buckets"]["file"]
    out = args.out or SERVING_DIR / (window_kv_file_name(name) if args.window_kv else name)
    text = render(recipe_geometry(recipe), out.name, args.variant, args.window_kv, drafter_k)
    if args.check:
        if not out.exists() or out.read_text() != text:
            print(f"{out} differs from what `{command_line(args.variant, args.window_kv)}` generates", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
