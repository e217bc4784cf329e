"""What a bucket file pads a decode step to, and which decode graph shapes a speculative verify
step forms that no prepared bucket names.

vllm-gaudi looks a decode step up in its sorted decode buckets: the first (batch, 1, blocks) whose
batch and blocks are both at least the step's. A plain decode step (one token per sequence) of n
sequences with s KV blocks in all runs as that bucket: its batch rows, its blocks. A verify step
(t = 1 + most drafts of any sequence, t > 1) first pads n to the batch of the first seed bucket
(the file's own decode buckets) that holds (n, s), then runs batch x t one-token rows whose block
list is t x s long (each sequence's table once per row; stock vllm-gaudi, the port's per-row
tables can add one block per row past a block boundary), padded to the blocks of the first
prepared bucket holding (batch x t, t x s). The graph then has batch x t rows: for t < k + 1 a row
count that vllm-gaudi's spec buckets (batch x (k+1)) do not name unless a seed has it. With
VLLM_SKIP_WARMUP=true (the recipe's) every shape compiles at its first step, named or not; an
unnamed one is a graph the count against max_decode_graphs does not include.

Usage (from the repository root): python -m serving.decode_padding [FILE ...] [--speculative-tokens K]
Without FILE: the recipe's file as launch.sh serves it (no drafts), and the speculative and DFlash2
variants' files at their k (the DFlash2 one with its drafter block graphs in the count); each FILE
is read at K drafts (default 0).
Each cell is rows x / blocks x: the padded step's rows and KV blocks over the step's own. The
last column is the sliding-window block list's (every row's last window blocks, padded to a
bucket of the step's rows; with Beam's window of 512 that list is read by 43 of its 52 layers).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from beam_hpu.runtime.sliding_window.hpu_window import window_block_count
from serving.lint_buckets import (DRAFT_VARIANTS, drafter_block_batches, drafts_in_block_graphs, parse_bucket_text,
                                  speculative_decode_buckets, speculative_tokens, vllm_gaudi_filter)
from serving.recipe import SERVING_DIR, Geometry, load_recipe, recipe_geometry

# Tokens per sequence of the printed table's columns, and the batches of its rows.
TABLE_CONTEXTS = (1024, 4096, 16384, 32768, 65536, 131072, 262144)
TABLE_BATCHES = (1, 2, 3, 4, 5, 8, 12, 16)
# The worst factor is taken from this many tokens per sequence on: below it every file pads a
# few blocks to its smallest tier, a large factor of a small amount.
WORST_FROM_TOKENS = 16384

Shape = tuple[int, int, int]


def seed_decode_buckets(text: str, g: Geometry) -> list[Shape]:
    """The file's decode buckets as vllm-gaudi keeps them."""
    buckets, _ = parse_bucket_text(text)
    kept = {vllm_gaudi_filter(b, g)[0] for b in buckets if b.query == 1}
    return sorted(kept - {None})


def prepared_decode_buckets(seeds, k: int, g: Geometry) -> list[Shape]:
    return sorted(speculative_decode_buckets(seeds, k, g) if k else set(seeds))


def lookup(sorted_buckets, batch: int, blocks: int) -> Shape | None:
    """The first bucket, in sorted order, with at least `batch` and `blocks`."""
    return next((b for b in sorted_buckets if b[0] >= batch and b[2] >= blocks), None)


def plain_step(prepared, n: int, blocks: int) -> Shape | None:
    return lookup(prepared, n, blocks)


def verify_step(seeds, prepared, n: int, blocks: int, t: int) -> tuple[int, int] | None:
    """(rows, padded block list) of a verify step of n sequences with `blocks` KV blocks in all,
    t tokens per sequence (stock block lists)."""
    seed = lookup(seeds, n, blocks) or lookup(prepared, n, blocks)
    if seed is None:
        return None
    rows = seed[0] * t
    bucket = lookup(prepared, rows, t * blocks)
    return None if bucket is None else (rows, bucket[2])


def unnamed_verify_shapes(seeds, prepared, k: int, g: Geometry) -> set[tuple[int, int]]:
    """(rows, blocks) graphs verify steps with 2..k+1 tokens per sequence can form that no
    prepared bucket names."""
    per_seq = math.ceil(g.max_model_len / g.block_size)
    named = {(b, c) for b, _, c in prepared}
    # A lookup's answer changes only past a bucket's blocks: trying 1 and each edge + 1 finds all.
    probes = sorted({1} | {c + 1 for _, _, c in prepared})
    shapes = set()
    for batch in sorted({b for b, _, _ in seeds}):
        for t in range(2, k + 2):
            for x in (p for p in probes if p <= t * batch * per_seq):
                bucket = lookup(prepared, batch * t, x)
                if bucket is not None:
                    shapes.add((batch * t, bucket[2]))
    return shapes - named


def padding(step: tuple[int, int] | None, rows: int, blocks: int) -> tuple[float, float] | None:
    """(row factor, block factor) of a step padded to `step` (rows, blocks)."""
    return None if step is None else (step[0] / rows, step[1] / blocks)


def report(name: str, text: str, g: Geometry, k: int, drafter_graphs: bool = False) -> list[str]:
    seeds = seed_decode_buckets(text, g)
    prepared = prepared_decode_buckets(seeds, k, g)
    unnamed = unnamed_verify_shapes(seeds, prepared, k, g) if k else set()
    if k:
        drafter = sorted(drafter_block_batches(seeds, prepared, g)) if drafter_graphs else []
        graphs = (f"{len(prepared)} prepared graphs" if not drafter else
                  f"{len(prepared)} prepared graphs and {len(drafter)} drafter block graphs (padded batches "
                  f"{', '.join(map(str, drafter))}), {len(prepared) + len(drafter)} in all")
        head = (f"{name}: {len(seeds)} decode buckets; with {k} speculative tokens {graphs} "
                f"(limit {g.max_decode_graphs}), and verify steps with 2..{k} tokens a sequence can form "
                f"{len(unnamed)} more shapes no bucket names (each compiled at first use)")
    else:
        head = f"{name}: {len(seeds)} decode buckets, {len(prepared)} graphs (limit {g.max_decode_graphs}), no speculation"
    # vllm-gaudi's warmup takes a decode graph's memory as proportional to its batch (rows).
    lines = [head, f" rows over all prepared graphs (vllm-gaudi's warmup: decode graph memory in proportion to rows): "
                   f"{sum(b for b, _, _ in prepared)}"]
    header = ("  batch " + "".join(f"{c // 1024:>11}K" for c in TABLE_CONTEXTS) + f"   worst from {WORST_FROM_TOKENS // 1024}K"
              + "   window blocks x")
    per_seq = math.ceil(g.max_model_len / g.block_size)
    kinds = [("plain decode, rows x / blocks x", None)] + ([(f"verify, {k + 1} tokens a sequence", k + 1)] if k else [])
    for title, t in kinds:
        lines += [f" {title}:", header]
        for n in TABLE_BATCHES:
            if n > g.max_num_seqs:
                continue
            cells = []
            for tokens in TABLE_CONTEXTS:
                cells.append(_cell(seeds, prepared, n, math.ceil(tokens / g.block_size), t))
            worst = max((_factors(seeds, prepared, n, bps, t) or (math.inf, math.inf))[1]
                        for bps in range(math.ceil(WORST_FROM_TOKENS / g.block_size) + 1, per_seq + 1))
            lines.append(f"  {n:>5} " + "".join(f"{c:>12}" for c in cells) + f"   blocks x {worst:.2f}"
                         + f"   {_window_factor(seeds, prepared, n, t, g)}")
    return lines


def _factors(seeds, prepared, n: int, blocks_per_seq: int, t: int | None):
    blocks = n * blocks_per_seq
    if t is None:
        bucket = plain_step(prepared, n, blocks)
        return padding(bucket and (bucket[0], bucket[2]), n, blocks)
    return padding(verify_step(seeds, prepared, n, blocks, t), n * t, t * blocks)


def _window_factor(seeds, prepared, n: int, t: int | None, g: Geometry) -> str:
    """The sliding-window block list (its blocks a row, any context past the window) over its
    padded bucket's blocks: vllm-gaudi pads it to a decode bucket of the step's rows too."""
    if not g.sliding_window:
        return "-"
    per_row = window_block_count(g.sliding_window, g.block_size)
    seed = lookup(prepared if t is None else seeds, n, n * per_row)
    rows = seed[0] * (t or 1)
    bucket = lookup(prepared, rows, rows * per_row)
    return "no bucket" if bucket is None else f"{bucket[2] / (n * (t or 1) * per_row):.2f}"


def _cell(seeds, prepared, n, blocks_per_seq, t) -> str:
    f = _factors(seeds, prepared, n, blocks_per_seq, t)
    return "no bucket" if f is None else f"{f[0]:.2g}/{f[1]:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Decode padding and unnamed verify shapes of bucket files.")
    parser.add_argument("files", type=Path, nargs="*", help="default: the recipe's file and the draft variants'")
    parser.add_argument("--recipe", type=Path, default=SERVING_DIR / "recipe.yaml")
    parser.add_argument("--speculative-tokens", type=int, default=0, help="drafts per step for each FILE (default 0)")
    args = parser.parse_args(argv)
    recipe = load_recipe(args.recipe)
    g = recipe_geometry(recipe)
    runs = [(path, args.speculative_tokens, False) for path in args.files] or [
        (SERVING_DIR / recipe["buckets"]["file"], 0, False)] + [
        (SERVING_DIR / recipe[variant]["buckets"]["file"], speculative_tokens(recipe, variant),
         drafts_in_block_graphs(recipe, variant)) for variant in DRAFT_VARIANTS]
    for path, k, drafter in runs:
        print("\n".join(report(path.name, path.read_text(), g, k, drafter)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
