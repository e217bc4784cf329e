"""serving/decode_padding.py by hand on a small geometry, and its report on the committed files
(the tree's own lookups and decode step agree with it: tests/runtime/speculative/test_tree_verify_buckets.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from serving.decode_padding import lookup, padding, plain_step, unnamed_verify_shapes, verify_step
from serving.recipe import Geometry

REPO = Path(__file__).resolve().parents[2]
# 8 blocks a sequence at max_model_len
G = Geometry(block_size=128, max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=2048,
             max_prefill_batch_size=1, sliding_window=0, max_decode_graphs=25)


def test_lookup_takes_the_first_bucket_in_sorted_order_with_both_at_least():
    buckets = [(1, 1, 8), (2, 1, 4), (2, 1, 16)]
    assert lookup(buckets, 1, 8) == (1, 1, 8)
    assert lookup(buckets, 1, 9) == (2, 1, 16)  # more blocks than batch 1 has: the next batch
    assert lookup(buckets, 2, 3) == (2, 1, 4)
    assert lookup(buckets, 3, 1) is None
    assert padding((2, 16), 1, 9) == (2.0, 16 / 9)
    assert plain_step(buckets, 2, 5) == (2, 1, 16)


def test_a_verify_step_pads_its_batch_to_a_seed_then_its_rows_blocks_to_a_prepared_bucket():
    seeds = [(1, 1, 8)]
    prepared = [(1, 1, 8), (3, 1, 8), (3, 1, 24)]  # k = 2
    # one sequence of 2 blocks, 3 tokens: 3 rows, 6 blocks -> (3, 1, 8)
    assert verify_step(seeds, prepared, 1, 2, 3) == (3, 8)
    # 4 blocks: 12 -> (3, 1, 24); 2 tokens: 2 rows (no bucket has 2 rows), 8 blocks -> (3, 1, 8)
    assert verify_step(seeds, prepared, 1, 4, 3) == (3, 24)
    assert verify_step(seeds, prepared, 1, 4, 2) == (2, 8)
    assert verify_step(seeds, prepared, 2, 4, 2) is None  # no seed holds 2 sequences


def test_unnamed_verify_shapes_are_the_row_counts_spec_buckets_do_not_name():
    seeds = [(1, 1, 8)]
    # k = 1: the only verify row count is 2, named by vllm-gaudi's spec buckets
    assert unnamed_verify_shapes(seeds, [(1, 1, 8), (2, 1, 8), (2, 1, 16)], 1, G) == set()
    # k = 2: a step with one draft has 2 rows, padded to (3, 1, 8) or (3, 1, 24)'s blocks
    assert unnamed_verify_shapes(seeds, [(1, 1, 8), (3, 1, 8), (3, 1, 24)], 2, G) == {(2, 8), (2, 24)}


def test_the_report_on_the_committed_files():
    run = subprocess.run([sys.executable, "-m", "serving.decode_padding"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "tp8-seqs16-256k.txt: 23 decode buckets, 23 graphs (limit 25), no speculation" in out
    assert ("tp8-seqs16-256k-spec.txt: 8 decode buckets; with 4 speculative tokens 24 prepared graphs (limit 25), "
            "and verify steps with 2..4 tokens a sequence can form 30 more shapes") in out
    assert ("tp8-seqs16-256k-dflash2.txt: 7 decode buckets; with 7 speculative tokens 21 prepared graphs and 4 "
            "drafter block graphs (padded batches 1, 4, 8, 16), 25 in all (limit 25)") in out
    lines = out.splitlines()
    spec = lines.index(next(line for line in lines if line.startswith("tp8-seqs16-256k-spec.txt")))
    # batch 2 under the variant runs as 4 rows; at 64K a sequence its 1024 blocks pad to 2048
    row = next(line for line in lines[spec:] if line.split()[:1] == ["2"])
    assert row.split()[5] == "2/2.00"
