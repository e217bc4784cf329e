"""Decode and verify steps over per-group block tables, on the vllm-gaudi tree named by
GAUDI_FIXES_ROOT (skipped without it), with the KV-cache groups and tables of vLLM's own
KVCacheManager for Beam's 52 layers under a window-sized cache.

For each group the tree's whole _create_decode_input_data builds the step from that group's table
(tests/support/gaudi/window_kv_decode.py), the tree's VLLMKVCache.forward writes every layer's keys at the step's slot
mapping into the buffer the layer shares (window_kv.shared_buffer_layers), and the tree's
_set_block_mapping turns the block lists into the masks attention applies: the full group's
block list for full layers, the window block list for sliding layers. Every key each row attends
is read back and must be exactly the definition's (query i sees i - W < j <= i in sliding layers,
everything in full layers), written by that layer for that sequence: not the null block, not
another request's or another group's key. The run spans freed and reused blocks, finished and newly
admitted requests, and verify steps with uneven drafts (rejected drafts' keys left behind).
Prefix-cache hits and prefill chunks are covered at the rule level, against vLLM's manager, by
tests/runtime/window_kv/test_groups_vllm.py; the tree's prefill path per group is not run here.

It shows that with the port's beam-exact-window the per-table code serves a sliding group's
null-prefixed table, and that without the port it does not (vllm-gaudi's block-granular window
reads too few keys).
"""
from __future__ import annotations

import pytest

from tests.support.gaudi.tree import port_tree_fixture
from tests.support.gaudi.window_kv_decode import Cluster

pytestmark = pytest.mark.gaudi_tree
K = 3  # the most drafts a verify row carries
tree = port_tree_fixture()


def run(tree, seed: int, steps: int) -> Cluster:
    cluster = Cluster(tree, seed)
    rng = cluster.rng
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(2, 20))] for _ in range(3)]
    seqs = [cluster.admit(f"r{i}", p) for i, p in enumerate(prompts)]
    for seq in seqs:  # the prompt's last token is sampled: one committed token to compute
        seq.tokens.append(rng.randrange(1000))
        seq.req.append_output_token_ids(seq.tokens[-1])
    admitted = len(seqs)
    for t in range(steps):
        verify = t % 2 == 1
        num_tokens = [rng.randint(1, K + 1) if verify else 1 for _ in seqs]
        cluster.commit(seqs, cluster.step(seqs, num_tokens))
        if t % 7 == 6:  # a request finishes (its blocks go back) and another is admitted
            done = seqs.pop(0)
            cluster.manager.free(done.req)
            new = cluster.admit(f"r{admitted}", [rng.randrange(1000) for _ in range(rng.randrange(2, 24))])
            admitted += 1
            new.tokens.append(rng.randrange(1000))
            new.req.append_output_token_ids(new.tokens[-1])
            seqs.append(new)
    return cluster


def test_per_group_decode_and_verify_steps_read_exact_windows(tree):
    cluster = run(tree, seed=0, steps=16)
    assert len(cluster.groups) == 6 and len(cluster.caches) == 9
    # The run met freed columns and blocks that changed owner (group or request).
    assert cluster.null_columns > 0 and cluster.reused > 0 and cluster.rows_checked > 1500
    if tree.port:
        assert cluster.mismatches == 0, cluster.first_mismatch
    else:  # vllm-gaudi's block-granular window (and verify rows' shared table) read the wrong keys
        assert cluster.mismatches > 0
