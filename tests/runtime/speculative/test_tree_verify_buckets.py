"""Decode buckets of a speculative verify step on the recipe's flags, against the vllm-gaudi tree
named by GAUDI_FIXES_ROOT (skipped without it).

The tree's own HPUBucketingManager reads the recipe's bucket file or the speculative variant's
(serving/launch-speculative.sh's; VLLM_BUCKETING_FROM_FILE,
VLLM_CONTIGUOUS_PA=false, --block-size, --max-model-len, --max-num-seqs from serving/recipe.yaml)
with the speculative variant's 4 drafts, and the tree's whole _create_decode_input_data builds
each step (tests/support/gaudi/decode_step.py). The port's per-row block tables (a row past a block boundary gets one
block more) make a step's block list up to one block per crossing row longer than stock's; every
such list must still land in a prepared bucket (no fallback bucket added mid-serving, no list
longer than its bucket), for the full and the sliding-window block lists alike. The variant's
file prepares, by the tree's count, what serving/lint_buckets.py counts, within the recipe's
graph limit, and serving/decode_padding.py pads steps as the tree's lookups and decode step do. The
DFlash2 variant's file (serving/launch-dflash2.sh's, 7 drafts) prepares the linter's count too, and
the padded batches the tree's lookups give its decode steps are the linter's drafter block graphs.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from serving.recipe import SERVING_DIR, load_recipe, recipe_geometry
from tests.support.gaudi.decode_step import bucketing_manager, decode_step, recipe_bucket_config
from tests.support.gaudi.tree import gaudi_root, port_tree_fixture

pytestmark = pytest.mark.gaudi_tree
tree = port_tree_fixture()

RECIPE = load_recipe()
GEOMETRY = recipe_geometry(RECIPE)
DRAFTS = json.loads(RECIPE["speculative"]["serve"]["speculative-config"])["num_speculative_tokens"]
BS = GEOMETRY.block_size
PER_SEQ = math.ceil(GEOMETRY.max_model_len / BS)  # a sequence's most blocks
KV_BLOCKS = 776_448 // BS  # the recipe's KV pool per replica


RECIPE_FILE = SERVING_DIR / RECIPE["buckets"]["file"]
VARIANT_FILE = SERVING_DIR / RECIPE["speculative"]["buckets"]["file"]
DFLASH2_FILE = SERVING_DIR / RECIPE["dflash2"]["buckets"]["file"]
DFLASH2_DRAFTS = json.loads(RECIPE["dflash2"]["serve"]["speculative-config"])["num_speculative_tokens"]


def recipe_buckets(root, drafts=DRAFTS, bucket_file=RECIPE_FILE):
    """The tree's bucketing manager after vllm-gaudi's decode bucket generation (no fix touches
    extension/bucketing/)."""
    manager = bucketing_manager(root, recipe_bucket_config(bucket_file))()
    manager.initialize(max_num_seqs=GEOMETRY.max_num_seqs, max_num_prefill_seqs=GEOMETRY.max_prefill_batch_size,
                       block_size=BS, max_num_batched_tokens=GEOMETRY.max_num_batched_tokens,
                       max_model_len=GEOMETRY.max_model_len, num_speculative_tokens=drafts)
    manager.num_hpu_blocks = KV_BLOCKS
    manager.generate_decode_buckets()
    return manager


def verify(tree, manager, context_lens, num_tokens):
    """The step's (rows, full block list length, its bucket, window block list length, its bucket)."""
    width = max(c // BS + 1 + 1 for c in context_lens)
    table = torch.stack([torch.arange(s * PER_SEQ, s * PER_SEQ + width, dtype=torch.int32) % KV_BLOCKS
                         for s in range(GEOMETRY.max_num_seqs)])
    prepared = list(manager.decode_buckets)
    out = decode_step(tree.runner, block_table=table, context_lens=context_lens, num_tokens=num_tokens,
                      token_ids=[[1] * n for n in num_tokens], block_size=BS, window=GEOMETRY.sliding_window,
                      num_kv_blocks=KV_BLOCKS, bucketing=manager)
    assert manager.decode_buckets == prepared, "the step added a fallback bucket"
    meta = out.attn_metadata
    rows = len(out.token_ids)
    full = (int((meta.block_groups >= 0).sum()), meta.block_list.numel())
    window = (int((meta.window_block_groups >= 0).sum()), meta.window_block_list.numel())
    return rows, full, window


def assert_in_prepared_buckets(manager, rows, *lists):
    shapes = {b[2] for b in manager.decode_buckets if b[0] >= rows}
    for used, padded in lists:
        assert used <= padded and padded in shapes, (rows, used, padded)


def test_spec_buckets_are_the_seeds_times_k_plus_1():
    manager = recipe_buckets(gaudi_root())
    seeds = manager.seed_decode_buckets
    assert {b[0] for b in seeds} == {1, 2, 4, 8, 16}
    added = sorted(set(manager.decode_buckets) - set(seeds))
    # vllm-gaudi adds (batch x (k+1), blocks) and (batch x (k+1), blocks x (k+1)), the latter capped
    # at every row's most blocks: the top bucket of each batch holds (k+1) rows per sequence at
    # max_model_len, as many blocks as a verify step can have even with one more block per row
    for batch in (1, 2, 4, 8, 16):
        top = max(b[2] for b in added if b[0] == batch * (DRAFTS + 1))
        assert top == batch * (DRAFTS + 1) * PER_SEQ
    assert len(seeds) <= GEOMETRY.max_decode_graphs < len(manager.decode_buckets)


def test_the_linters_speculative_graph_count_is_the_trees(tree):
    # serving/lint_buckets.py counts the graphs of the speculative variant by its own formula;
    # the tree's manager, run on the same file, must prepare exactly those buckets
    from serving.lint_buckets import speculative_decode_buckets

    for drafts in (1, 2, DRAFTS, 7):
        manager = recipe_buckets(tree.root, drafts)
        ours = speculative_decode_buckets(manager.seed_decode_buckets, drafts, GEOMETRY)
        assert ours == set(manager.decode_buckets), drafts


def test_a_crossing_row_at_a_bucket_edge_moves_the_port_to_the_next_prepared_bucket(tree):
    manager = recipe_buckets(tree.root)
    # one sequence, 32 blocks (its seed bucket (1, 1, 32)); 3 of its 5 rows are past the block
    # boundary at 4,096
    rows, full, window = verify(tree, manager, [32 * BS - 2], [DRAFTS + 1])
    assert rows == DRAFTS + 1
    if tree.port:
        assert full == (5 * 32 + 3, 512)  # (5, 1, 160) is one block per crossing row short
    else:
        assert full == (5 * 32, 160)
    assert_in_prepared_buckets(manager, rows, full, window)


@pytest.fixture(params=[(RECIPE_FILE, DRAFTS), (VARIANT_FILE, DRAFTS), (DFLASH2_FILE, DFLASH2_DRAFTS)],
                ids=lambda p: f"{p[0].name}-k{p[1]}")
def bucket_file(request):
    """A bucket file and the drafts a step verifies with it."""
    return request.param


def test_verify_steps_at_max_model_len_fit_the_top_bucket(tree, bucket_file):
    bucket_file, drafts = bucket_file
    manager = recipe_buckets(tree.root, drafts, bucket_file)
    ctx = GEOMETRY.max_model_len - (drafts + 1)  # the last verify step a sequence can take
    for num_decodes in (1, 16):
        rows, full, window = verify(tree, manager, [ctx] * num_decodes, [drafts + 1] * num_decodes)
        assert rows == num_decodes * (drafts + 1)
        assert full == (rows * PER_SEQ, rows * PER_SEQ)
        assert_in_prepared_buckets(manager, rows, full, window)


def test_verify_steps_land_in_prepared_buckets(tree, bucket_file):
    bucket_file, drafts = bucket_file
    manager = recipe_buckets(tree.root, drafts, bucket_file)
    rng = np.random.default_rng(16)
    edges = [b * BS + d for b in (1, 4, 32, 128, 512, 1024, 2047) for d in range(-drafts - 1, 2)]
    for _ in range(48):
        n = int(rng.choice([1, 2, 3, 5, 8, 13, 16]))
        ctx = [int(rng.choice(edges)) for _ in range(n)]
        counts = [int(rng.integers(1, drafts + 2)) for _ in range(n)]
        counts[0] = max(counts[0], 2)  # a verify step: some sequence has a draft
        rows, full, window = verify(tree, manager, ctx, counts)
        assert rows % max(counts) == 0 and rows // max(counts) in {b[0] for b in manager.seed_decode_buckets}
        assert_in_prepared_buckets(manager, rows, full, window)


def test_the_variants_file_prepares_the_linters_count_within_the_graph_limit():
    from serving.lint_buckets import speculative_decode_buckets

    for drafts in (1, 2, 3, DRAFTS, 7):
        manager = recipe_buckets(gaudi_root(), drafts, VARIANT_FILE)
        assert {b[0] for b in manager.seed_decode_buckets} == {1, 4, 16}
        ours = speculative_decode_buckets(manager.seed_decode_buckets, drafts, GEOMETRY)
        assert ours == set(manager.decode_buckets), drafts
        assert len(manager.decode_buckets) <= GEOMETRY.max_decode_graphs, drafts
    assert len(recipe_buckets(gaudi_root(), DRAFTS, VARIANT_FILE).decode_buckets) == 24


def test_the_dflash2_file_prepares_the_linters_graphs_and_drafter_batches():
    # 21 verify-step graphs at 7 drafts by the tree's own generation, and the batches its lookups pad
    # a decode step to (a verify step: the seed lookup; a step without drafts: the prepared one) are
    # the drafter block graphs serving/lint_buckets.py adds: 25 in all
    from serving.lint_buckets import drafter_block_batches, speculative_decode_buckets

    manager = recipe_buckets(gaudi_root(), DFLASH2_DRAFTS, DFLASH2_FILE)
    seeds, prepared = list(manager.seed_decode_buckets), list(manager.decode_buckets)
    assert speculative_decode_buckets(seeds, DFLASH2_DRAFTS, GEOMETRY) == set(prepared) and len(prepared) == 21
    edges = sorted({b[2] for b in prepared})
    batches = set()
    for n in range(1, GEOMETRY.max_num_seqs + 1):
        for blocks in sorted({n, n * PER_SEQ} | {e + d for e in edges for d in (0, 1) if n <= e + d <= n * PER_SEQ}):
            batches |= {manager.find_decode_bucket(n, blocks, True)[0], manager.find_decode_bucket(n, blocks)[0]}
    assert manager.decode_buckets == prepared  # no fallback bucket was added
    assert batches == drafter_block_batches(seeds, prepared, GEOMETRY) == {1, 4, 8, 16}
    assert len(prepared) + len(batches) <= GEOMETRY.max_decode_graphs


def test_decode_padding_looks_buckets_up_as_the_tree_does(bucket_file):
    from serving.decode_padding import lookup, plain_step

    bucket_file, drafts = bucket_file
    manager = recipe_buckets(gaudi_root(), drafts, bucket_file)
    seeds, prepared = list(manager.seed_decode_buckets), list(manager.decode_buckets)
    for n in range(1, GEOMETRY.max_num_seqs + 1):
        for blocks in sorted({n, n * 5, n * 32 + 1, n * 129, n * 512, n * 1025, n * PER_SEQ - 1, n * PER_SEQ}):
            assert plain_step(prepared, n, blocks) == manager.find_decode_bucket(n, blocks), (n, blocks)
            assert lookup(seeds, n, blocks) == manager.find_decode_bucket(n, blocks, True), (n, blocks)
    assert manager.decode_buckets == prepared  # no fallback bucket was added


def test_decode_padding_predicts_the_trees_verify_steps(tree, bucket_file):
    # contexts where no verify row crosses a block boundary, so the port's per-row tables are
    # stock's: the step's rows and padded block list are what serving/decode_padding.py says
    from serving.decode_padding import verify_step

    bucket_file, drafts = bucket_file
    manager = recipe_buckets(tree.root, drafts, bucket_file)
    seeds, prepared = list(manager.seed_decode_buckets), list(manager.decode_buckets)
    rng = np.random.default_rng(23)
    for _ in range(24):
        n = int(rng.choice([1, 2, 3, 4, 5, 8, 12, 16]))
        ctx = [int(rng.choice([1, 31, 127, 500, 1023, 2040])) * BS + int(rng.integers(0, BS - drafts - 1))
               for _ in range(n)]
        counts = [int(rng.integers(1, drafts + 2)) for _ in range(n)]
        counts[0] = max(counts[0], 2)
        rows, full, _ = verify(tree, manager, ctx, counts)
        blocks = sum(math.ceil((c + 1) / BS) for c in ctx)
        assert (rows, full[1]) == verify_step(seeds, prepared, n, blocks, max(counts)), (ctx, counts)
