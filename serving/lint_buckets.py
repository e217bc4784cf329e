"""Lint a vllm-gaudi bucket file (VLLM_BUCKETING_FROM_FILE) against the launch flags.

The file is read the way vllm-gaudi's file strategy reads it: blank and `#` lines skipped,
`range(a, b[, c])` expanded to a list (up to 10,000 elements) before `ast.literal_eval`, each line
a tuple of three ints or lists of ints, the Cartesian product taken, query length 1 meaning a
decode bucket. Then vllm-gaudi's filters are applied (prompt: context within max_model_len,
batch * query within --max-num-batched-tokens; decode: batch <= blocks, blocks capped at
batch * ceil(max_model_len / block_size)). Checked:

- every line parses to something vllm-gaudi uses (it skips, crashes on or silently drops the rest);
- every prompt chunk the flags allow (batch up to the prefill batch size, 2..max-num-batched-tokens
  query tokens, any context that fits in max_model_len) falls in some bucket;
- every decode batch (1..max-num-seqs sequences, any total of KV blocks up to each sequence at
  max_model_len) falls in some bucket, and the sliding-window block list of each padded batch
  fits that batch size's smallest bucket (else one batch shape captures two graphs);
- no bucket is for a batch the flags never form, and the number of decode graphs stays within
  the stated limit (each captured graph holds device memory); with `--speculative` (the recipe's
  speculative variant, k drafted tokens) counted as vllm-gaudi generates them under speculation:
  every seed decode bucket (b, 1, c) also gives (b(k+1), 1, c) when b(k+1) <= c and
  (b(k+1), 1, c(k+1)), both capped at b(k+1) rows' blocks at max_model_len (VLLM_CONTIGUOUS_PA=false,
  the recipe's), so up to three graphs per seed; with `--dflash2` (the DFlash2 variant, method
  dflash) also one captured drafter block graph per batch a decode step is padded to (the port's
  proposer captures its block forward once per padded batch: a verify step's batch is the seed
  bucket's that holds it, a step without drafts the prepared bucket's).

With `--window-kv` (BEAM_WINDOW_KV=1, a window-sized KV cache for the sliding layers) the file
is also checked for per-group block lists: vllm-gaudi pads each KV-cache group's decode block list
to a decode bucket found from that group's own block count, and a sliding group's list holds at
most window_block_count blocks a row (5 at window 512, block 128); each batch's bucket that list
lands in must be exactly batch x 5 blocks, else 43 of 52 layers gather padding blocks every step
(the recipe's file pads them to its 4K tier, 32 blocks a row). `python -m serving.make_buckets
--window-kv` writes the re-derived file.

A runtime lookup that misses every bucket compiles a fallback graph mid-serving; a dropped or
unreachable bucket wastes warmup time and graph memory.

Usage (from the repository root):
    python -m serving.lint_buckets [FILE] [--recipe recipe.yaml] [--speculative | --dflash2] [--window-kv]
FILE defaults to the recipe's buckets.file, with --speculative (--dflash2) to its speculative
(dflash2) section's buckets.file, with --window-kv to that file's window-KV variant (<file>-window.txt).
Exit status 0 when clean, 1 with one `FILE:LINE: problem` per problem otherwise.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import itertools
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from beam_hpu.runtime.sliding_window.hpu_window import window_block_count
from serving.recipe import SERVING_DIR, Geometry, load_recipe, recipe_geometry, window_kv_file_name

RANGE_CALL = re.compile(r"range\(\s*(-?\d+)\s*,\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?\)")
MAX_RANGE_ELEMENTS = 10_000  # vllm-gaudi leaves longer ranges unexpanded: the line then fails to parse


@dataclass(frozen=True)
class Bucket:
    batch: int
    query: int
    blocks: int
    line: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.batch, self.query, self.blocks)


def expand_ranges(text: str) -> str:
    def as_list(match: re.Match) -> str:
        start, stop = int(match.group(1)), int(match.group(2))
        step = int(match.group(3) or 1)
        if step == 0 or len(range(start, stop, step)) > MAX_RANGE_ELEMENTS:
            return match.group(0)
        return repr(list(range(start, stop, step)))

    return RANGE_CALL.sub(as_list, text)


def parse_bucket_text(text: str) -> tuple[list[Bucket], list[str]]:
    """Buckets (with their line numbers) and `LINE: problem` messages for lines vllm-gaudi would
    skip or crash on."""
    buckets, problems = [], []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            value = ast.literal_eval(expand_ranges(line))
        except (ValueError, SyntaxError):
            problems.append(f"{number}: vllm-gaudi skips it: not a literal (or a range over {MAX_RANGE_ELEMENTS:,}): {line}")
            continue
        if not isinstance(value, tuple) or len(value) != 3:
            problems.append(f"{number}: vllm-gaudi skips it: not a tuple of 3 (batch, query, blocks): {line}")
            continue
        axes = [list(v) if isinstance(v, (list, range)) else [v] for v in value]
        bad = [v for axis in axes for v in axis if type(v) is not int or v < 0]
        if bad:
            # vllm-gaudi int()s every element: a string stops the server, a float is truncated.
            problems.append(f"{number}: {bad[0]!r} is not a non-negative int: {line}")
            continue
        if not all(axes):
            problems.append(f"{number}: an empty list makes no bucket: {line}")
            continue
        buckets += [Bucket(b, q, c, number) for b, q, c in itertools.product(*axes)]
    return buckets, problems


def vllm_gaudi_filter(bucket: Bucket, g: Geometry) -> tuple[tuple[int, int, int] | None, str | None]:
    """The bucket as vllm-gaudi keeps it (None if dropped), and why it was changed or dropped."""
    b, q, c = bucket.shape
    if q != 1:
        if c > math.ceil((g.max_model_len - 1) / g.block_size) or q > g.max_model_len:
            return None, f"context beyond --max-model-len {g.max_model_len}"
        if b * q > g.max_num_batched_tokens:
            return None, f"batch * query {b * q} over --max-num-batched-tokens {g.max_num_batched_tokens}"
        return bucket.shape, None
    if b > c:
        return None, "fewer blocks than sequences"
    cap = b * math.ceil(g.max_model_len / g.block_size)
    if c > cap:
        return (b, q, cap), f"cut to {cap} blocks, all {b} sequences at --max-model-len"
    return bucket.shape, None


def _covering_prompt_problems(prompts: list[Bucket], g: Geometry) -> list[str]:
    problems = []
    for batch in range(1, g.max_prefill_batch_size + 1):
        usable = sorted((p for p in prompts if p.batch >= batch), key=lambda p: p.query)
        queries = [p.query for p in usable]
        # best[i]: the bucket with most context among those with query >= queries[i]
        best, champion = [None] * len(usable), None
        for i in range(len(usable) - 1, -1, -1):
            if champion is None or usable[i].blocks > champion.blocks:
                champion = usable[i]
            best[i] = champion
        missed = []
        # A chunk of one token is a decode step to vllm-gaudi. Chunks of one batch share the token
        # budget; the longest that `batch` equal chunks can be is budget // batch.
        for query in range(2, min(g.max_num_batched_tokens // batch, g.max_model_len) + 1):
            need = math.ceil((g.max_model_len - query) / g.block_size)  # context before the chunk
            i = bisect.bisect_left(queries, query)
            if i == len(usable) or best[i].blocks < need:
                missed.append((query, need, best[i] if i < len(usable) else None))
        if missed:
            query, need, found = missed[0]
            most = f"the most context any bucket offers it is {found.blocks} blocks (line {found.line})" if found else "no bucket has that many query tokens"
            problems.append(
                f"prompt: batch {batch}, a {query}-token chunk after {need} context blocks falls in no "
                f"bucket ({len(missed)} chunk lengths like it); {most}"
            )
    return problems


def _covering_decode_problems(decodes: dict[tuple[int, int, int], Bucket], g: Geometry) -> list[str]:
    problems = []
    per_seq = math.ceil(g.max_model_len / g.block_size)
    for batch in range(1, g.max_num_seqs + 1):
        usable = [(shape, b) for shape, b in decodes.items() if shape[0] >= batch]
        need = batch * per_seq
        if not usable or max(shape[2] for shape, _ in usable) < need:
            most = max(usable, key=lambda u: u[0][2], default=None)
            where = f"the largest for batch >= {batch} is {most[0]} (line {most[1].line})" if most else "no bucket has that many sequences"
            problems.append(f"decode: {batch} sequences with up to {need} KV blocks fall in no bucket; {where}")
    if g.sliding_window:
        window_blocks = window_block_count(g.sliding_window, g.block_size)
        for batch in sorted({shape[0] for shape in decodes}):
            smallest = min((shape for shape in decodes if shape[0] == batch), key=lambda s: s[2])
            if smallest[2] < batch * window_blocks:
                problems.append(
                    f"{decodes[smallest].line}: decode: the smallest bucket for batch {batch}, {smallest[2]} blocks, "
                    f"is below its sliding-window block list ({batch} x {window_blocks}); window steps would "
                    "then use a second bucket and capture extra graphs"
                )
    return problems


def speculative_decode_buckets(seeds, speculative_tokens: int, g: Geometry) -> set[tuple[int, int, int]]:
    """The decode buckets vllm-gaudi prepares from seed decode buckets when it verifies
    `speculative_tokens` drafts per step (its verify rows are batch x (k+1) one-token rows)."""
    rows_per_seq = 1 + speculative_tokens
    per_seq = math.ceil(g.max_model_len / g.block_size)
    out = set(seeds)
    for b, q, c in seeds:
        rows = b * rows_per_seq
        if rows <= c:
            out.add((rows, q, min(c, rows * per_seq)))
        out.add((rows, q, min(c * rows_per_seq, rows * per_seq)))
    return out


def first_holding(sorted_buckets, batch: int, blocks: int) -> tuple[int, int, int] | None:
    """vllm-gaudi's decode lookup: the first bucket, in sorted order, with at least `batch` and `blocks`."""
    return next((b for b in sorted_buckets if b[0] >= batch and b[2] >= blocks), None)


def drafter_block_batches(seeds, prepared, g: Geometry) -> set[int]:
    """The padded batches a decode step of 1..max_num_seqs sequences runs at, each one captured
    drafter block graph: a verify step pads its sequences to the first seed bucket holding them
    (a prepared one when no seed does), a step without drafts to the first prepared bucket."""
    seeds, prepared = sorted(seeds), sorted(prepared)
    per_seq = math.ceil(g.max_model_len / g.block_size)
    # A lookup's answer changes only past a bucket's blocks: trying n and each edge + 1 finds all.
    probes = sorted({c + 1 for _, _, c in prepared})
    batches = set()
    for n in range(1, g.max_num_seqs + 1):
        for blocks in [n] + [p for p in probes if n < p <= n * per_seq]:
            for bucket in (first_holding(seeds, n, blocks) or first_holding(prepared, n, blocks),
                           first_holding(prepared, n, blocks)):
                if bucket is not None:
                    batches.add(bucket[0])
    return batches


def window_kv_problems(decodes: dict[tuple[int, int, int], Bucket], g: Geometry,
                       speculative_tokens: int = 0) -> list[str]:
    """Each batch whose sliding-group decode block lists (at most batch x window_block_count
    blocks) pad to a bigger bucket than that, naming the bucket that would hold them exactly."""
    window_blocks = window_block_count(g.sliding_window, g.block_size)
    shapes = speculative_decode_buckets(decodes, speculative_tokens, g) if speculative_tokens else set(decodes)
    problems = []
    for batch in sorted({shape[0] for shape in shapes}):
        need = batch * window_blocks
        landing = min((s for s in shapes if s[0] == batch and s[2] >= need), key=lambda s: s[2], default=None)
        if landing is None or landing[2] == need:
            continue  # none: the plain checks name the batch; equal: the window tier is there
        where = f"{decodes[landing].line}: " if landing in decodes else ""
        made = "" if landing in decodes else f" (made from the seeds for {speculative_tokens} speculative tokens)"
        problems.append(
            f"{where}decode (window KV): batch {batch}'s sliding-group block lists ({batch} x {window_blocks} = "
            f"{need} blocks at most) pad to {landing}{made}, {landing[2] / need:.1f}x their blocks in every "
            f"sliding layer; missing bucket ({batch}, 1, {need})")
    return problems


def lint_bucket_text(text: str, g: Geometry, speculative_tokens: int = 0, window_kv: bool = False,
                     drafter_graphs: bool = False) -> list[str]:
    """`FILE-LINE: problem` messages (the line part only for a line's problems); `drafter_graphs`
    adds the DFlash2 drafter's block graphs to the decode graph count."""
    buckets, problems = parse_bucket_text(text)
    prompts: list[Bucket] = []
    decodes: dict[tuple[int, int, int], Bucket] = {}
    seen: dict[tuple[int, int, int], int] = {}
    for bucket in buckets:
        if bucket.shape in seen:
            problems.append(f"{bucket.line}: {bucket.shape} is already listed on line {seen[bucket.shape]}")
            continue
        seen[bucket.shape] = bucket.line
        kept, why = vllm_gaudi_filter(bucket, g)
        if why:
            problems.append(f"{bucket.line}: vllm-gaudi {'drops' if kept is None else 'changes'} {bucket.shape}: {why}")
        if kept is None:
            continue
        limit = g.max_num_seqs if bucket.query == 1 else g.max_prefill_batch_size
        if bucket.batch > limit:
            problems.append(f"{bucket.line}: {bucket.shape}: batch {bucket.batch} is never formed (limit {limit})")
        if bucket.query == 1:
            decodes.setdefault(kept, bucket)
        else:
            prompts.append(bucket)

    problems += _covering_prompt_problems(prompts, g)
    problems += _covering_decode_problems(decodes, g)
    if len(decodes) > g.max_decode_graphs:
        problems.append(f"decode: {len(decodes)} buckets, each a captured graph; the limit is {g.max_decode_graphs}")
    elif speculative_tokens:
        prepared = speculative_decode_buckets(decodes, speculative_tokens, g)
        drafter = sorted(drafter_block_batches(decodes, prepared, g)) if drafter_graphs else []
        if len(prepared) + len(drafter) > g.max_decode_graphs:
            counted = (f"vllm-gaudi prepares {len(prepared)} decode buckets from these {len(decodes)} (batch x "
                       f"{speculative_tokens + 1} verify rows), each a captured graph")
            if drafter:
                counted += (f", and the DFlash2 drafter captures {len(drafter)} block graphs (padded batches "
                            f"{', '.join(map(str, drafter))}): {len(prepared) + len(drafter)} graphs")
            variant = "--dflash2" if drafter_graphs else "--speculative"
            problems.append(
                f"decode: with {speculative_tokens} speculative tokens {counted}; the limit is {g.max_decode_graphs} "
                f"(recipe.yaml buckets.max_decode_graphs); the variant's file has fewer decode seeds "
                f"(python -m serving.make_buckets {variant})")
    if window_kv and g.sliding_window:
        problems += window_kv_problems(decodes, g, speculative_tokens)
    return sorted(problems, key=_line_of)


def _line_of(problem: str) -> float:
    # Problems of a line first, in file order; those of the whole file after them.
    head = problem.split(":", 1)[0]
    return int(head) if head.isdigit() else math.inf


# recipe.yaml's sections that serve with drafts, each with its own bucket file.
DRAFT_VARIANTS = ("speculative", "dflash2")


def _speculative_config(recipe: dict, variant: str) -> dict:
    import json

    try:
        return json.loads(recipe[variant]["serve"]["speculative-config"])
    except (KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"recipe: {variant}.serve.speculative-config is not readable ({e!r})") from e


def speculative_tokens(recipe: dict, variant: str = "speculative") -> int:
    """num_speculative_tokens of one of the recipe's draft variants."""
    try:
        return int(_speculative_config(recipe, variant)["num_speculative_tokens"])
    except (KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"recipe: {variant}.serve.speculative-config has no num_speculative_tokens ({e!r})") from e


def drafts_in_block_graphs(recipe: dict, variant: str) -> bool:
    """Whether the variant's drafter captures block graphs of its own (method dflash: the port's
    DFlash2 proposer); prompt lookup and EAGLE draft inside the verify step's graphs."""
    return _speculative_config(recipe, variant).get("method") == "dflash"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Lint a vllm-gaudi bucket file against the launch flags.")
    parser.add_argument("file", type=Path, nargs="?",
                        help="default: serving/<buckets.file of the recipe>, with --speculative or --dflash2 that section's buckets.file")
    parser.add_argument("--recipe", type=Path, default=SERVING_DIR / "recipe.yaml", help="launch flags and limits")
    variants = parser.add_mutually_exclusive_group()
    variants.add_argument("--speculative", dest="variant", action="store_const", const="speculative",
                          help="lint for the recipe's speculative variant (its --speculative-config's num_speculative_tokens)")
    variants.add_argument("--dflash2", dest="variant", action="store_const", const="dflash2",
                          help="lint for the recipe's DFlash2 variant (its num_speculative_tokens and drafter block graphs)")
    parser.add_argument("--window-kv", action="store_true",
                        help="also check the per-group block lists of a window-sized KV cache (BEAM_WINDOW_KV=1)")
    args = parser.parse_args(argv)
    recipe = load_recipe(args.recipe)
    section = recipe[args.variant] if args.variant else recipe
    name = section["buckets"]["file"]
    if args.window_kv:
        name = window_kv_file_name(name)
    path = args.file or SERVING_DIR / name
    k = speculative_tokens(recipe, args.variant) if args.variant else 0
    drafter = bool(args.variant) and drafts_in_block_graphs(recipe, args.variant)
    if drafter and args.window_kv and not args.file:
        parser.error(f"--window-kv has no file for the {args.variant} variant (python -m serving.make_buckets)")
    problems = lint_bucket_text(path.read_text(), recipe_geometry(recipe), k, args.window_kv, drafter)
    for problem in problems:
        print(f"{path}:{problem}" if problem[:1].isdigit() else f"{path}: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
