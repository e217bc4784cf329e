"""Prefill chunks over cached context in a sliding KV-cache group, on the vllm-gaudi tree named by
GAUDI_FIXES_ROOT (skipped without it): the context block lists come from the sliding group's
tables of vLLM's own KVCacheManager mid-prefill, whose columns the window has left hold the null
block. The tree's (patched) _form_prefill_batch window statements and
_set_attn_bias_for_sliding_window (tests/support/gaudi/sliding_window.py)  must gather only live
blocks and attend exactly each row's window."""
from __future__ import annotations

import math
import random

import pytest

from beam_hpu.runtime.window_kv import groups as wkv
from tests.support.gaudi.sliding_window import prefill_attended
from tests.support.gaudi.tree import port_tree_fixture
from tests.support.window_kv.configs import beam_kv_cache_config

pytestmark = pytest.mark.gaudi_tree
tree = port_tree_fixture()


def sliding_context_blocks(bs, window, ctx_lens, query_lens, seed):
    """Each request prefilled to ctx_lens[b] in random chunks, then its next chunk allocated: the
    first sliding group's context columns, as the runner would hand them over."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    from vllm.v1.request import Request

    rng = random.Random(seed)
    _, kc = beam_kv_cache_config(bs, window, 400)
    gid = next(i for i, g in enumerate(kc.kv_cache_groups) if isinstance(g.kv_cache_spec, SlidingWindowSpec))
    manager = KVCacheManager(kc, max_model_len=4096, scheduler_block_size=bs, hash_block_size=bs,
                             enable_caching=False)
    blocks = []
    for b, (ctx, q) in enumerate(zip(ctx_lens, query_lens)):
        req = Request(f"r{b}", [1] * (ctx + q), SamplingParams(max_tokens=1), None)
        while req.num_computed_tokens < ctx:
            n = min(ctx - req.num_computed_tokens, rng.choice([1, bs - 1, 2 * bs + 3]))
            assert manager.allocate_slots(req, n) is not None
            req.num_computed_tokens += n
        assert manager.allocate_slots(req, q) is not None
        table = manager.get_block_ids(req.request_id)[gid]
        blocks.append(list(table[:math.ceil(ctx / bs)]))
    return blocks


@pytest.mark.parametrize("bs,window", [(4, 8), (4, 6), (128, 512)])
def test_prefill_over_a_sliding_groups_table_is_exact(tree, bs, window):
    if not tree.port:  # without the port beam's sliding layers take the whole context, freed columns too
        assert "prefill_window_context" not in tree.runner.read_text()
        return
    cases = [([window + 1, 3 * window + 2, 5 * bs + 1, 4 * window - 1], [3, 2, 5, 1]),
             ([7 * bs - 1, 7 * bs, 7 * bs + 1, 6 * window], [5, 4, 1, 3])]
    for seed, (ctx_lens, query_lens) in enumerate(cases):
        context_blocks = sliding_context_blocks(bs, window, ctx_lens, query_lens, seed)
        assert any(wkv.NULL_BLOCK_ID in c for c in context_blocks)  # the window has freed columns
        got = prefill_attended(tree, ctx_lens, query_lens, window, bs, max(query_lens) + 1, context_blocks)
        for b, (ctx, q) in enumerate(zip(ctx_lens, query_lens)):
            for i in range(q):
                pos = ctx + i
                assert got[b][i] == set(range(max(0, pos - window + 1), pos + 1)), (ctx, i)
