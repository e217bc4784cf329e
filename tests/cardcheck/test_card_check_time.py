"""benchmarks/card_check_time.py, the node-time model of card-check's engine A/B: its counts are
card-check's own (the starts run_switches makes, the bucket-file graphs a start's requests land in)
and it prints every assumption beside the card figure that replaces it."""

import subprocess
import sys
from pathlib import Path

from beam_hpu.cardcheck import engine_ab
from serving.lint_buckets import parse_bucket_text

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import card_check_time  # noqa: E402

BUCKETS = [b.shape for b in parse_bucket_text((REPO / "serving" / "tp8-seqs16-256k.txt").read_text())[0]]


def test_a_start_meets_the_buckets_its_requests_land_in():
    one = engine_ab.Workload(batches=(1,), decode_steps=64, prompt_len=512, contexts=())
    # 576 tokens in blocks of 128 fit 5 blocks: the smallest batch-1 decode bucket holds 32
    assert card_check_time.graphs_met(one, BUCKETS, 128, 4096) == {(1, 512, 0), (1, 1, 32)}
    long = engine_ab.Workload(batches=(), decode_steps=0, prompt_len=0, contexts=(131072,))
    # 32 chunks of 4096 after 0, 32, ..., 992 blocks of context: the exponential context buckets
    assert card_check_time.graphs_met(long, BUCKETS, 128, 4096) == {
        (1, 4096, c) for c in (0, 32, 64, 127, 254, 506, 1010)}


def test_the_model_counts_card_checks_starts_and_labels_itself():
    recipe = engine_ab.cookbook_recipe().load_recipe()
    switches = engine_ab.ab_switches(recipe)
    starts = 1 + sum(len(ab.settings) - 1 + sum(s.warm for s in ab.settings) for ab in switches)
    assert len(card_check_time.starts(recipe)) == starts
    proc = subprocess.run([sys.executable, "benchmarks/card_check_time.py", "--start-s", "100"], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("MODEL, not a measurement")
    assert f"counted: {starts} engine starts" in proc.stdout and "assumed: start 100 s [node card-check.json" in proc.stdout
    assert "whole run:" in proc.stdout and "(MODEL)" in proc.stdout
