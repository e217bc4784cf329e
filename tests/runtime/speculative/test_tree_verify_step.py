"""beam-exact-window on a speculative verify step, against the vllm-gaudi tree named by
GAUDI_FIXES_ROOT (skipped without it): the block tables of _create_decode_input_data's k+1 rows
per sequence, run from the (patched or v0.30.0-only) file itself, then read through the file's
own get_habana_paged_attn_buffers. With the port every row attends exactly its own causal
context; without it the rows past a block boundary do not.
"""
from __future__ import annotations

import ast
import itertools

import pytest
import torch

from beam_hpu.scope import is_beam_model_type
from tests.support.gaudi.source import RUNNER_CLS, find_def, load, method_body_if, run_block
from tests.support.gaudi.tree import port_tree_fixture

pytestmark = pytest.mark.gaudi_tree
tree = port_tree_fixture()

K = 4


def verify_rows(tree, ctx_lens, bs, model_type="beam"):
    """block_tables_list and slot_mapping as _create_decode_input_data builds them for a verify
    step of K drafts per sequence."""
    n_tokens = K + 1
    table = torch.stack([torch.arange(1000 * (s + 1), 1000 * (s + 1) + 32, dtype=torch.int32)
                         for s in range(len(ctx_lens))])
    method = find_def(ast.parse(tree.runner.read_text()), "_create_decode_input_data", RUNNER_CLS)
    loop = next(n for n in ast.walk(method) if isinstance(n, ast.For) and ast.unparse(n.iter) == "enumerate(num_blocks)")
    names = dict(block_tables_list=[], num_blocks=[c // bs + 1 for c in ctx_lens], block_table_cpu_tensor=table,
                 num_tokens=n_tokens, context_lens=list(ctx_lens), num_tokens_per_req=[n_tokens] * len(ctx_lens),
                 decode_block_size=bs, self=type("Runner", (), {"_get_model_type": lambda self: model_type})())
    names = run_block(loop, tree.runner, **names)
    if tree.port:
        patched = method_body_if(tree.runner, "_create_decode_input_data", RUNNER_CLS,
                                 "num_tokens > 1 and is_beam_model_type(self._get_model_type())")
        names = run_block(patched, tree.runner, **names, is_beam_model_type=is_beam_model_type)
    slots = [[int(table[s, (c + j) // bs]) * bs + (c + j) % bs] for s, c in enumerate(ctx_lens) for j in range(n_tokens)]
    return names["block_tables_list"], slots


def attended(tree, rows, slots, bs):
    """Per row, the positions the file's paged decode buffers let it attend."""
    from types import SimpleNamespace

    runner = SimpleNamespace(attn_block_size=bs, use_contiguous_pa=False, _PAD_BLOCK_ID=0,
                             model_config=SimpleNamespace(dtype=torch.float32),
                             bucketing_manager=SimpleNamespace(find_decode_bucket=lambda b, n: (b, 1, n + 3)),
                             get_dp_padding=lambda n: 0)
    paged = load(tree.runner, "get_habana_paged_attn_buffers", RUNNER_CLS, torch=torch, itertools=itertools,
                 flatten=lambda x: list(itertools.chain(*x)),
                 pad_list=lambda lst, n, gen: lst + list(itertools.islice(gen, n - len(lst))))
    block_list, groups, usage = paged(runner, rows, slots, len(rows), block_size=bs)
    seen = [set() for _ in rows]
    for bid, g, u in zip(block_list.tolist(), groups.tolist(), usage.tolist()):
        if g < 0:
            continue
        base = rows[g][0]
        seen[g] |= {(bid - base) * bs + o for o in range(int(u))}
    return seen


@pytest.mark.parametrize("bs", [4, 128])
def test_each_verify_row_attends_its_own_causal_context(tree, bs):
    ctx_lens = [0, bs - 3, bs - 1, bs, 2 * bs - 2, 5 * bs + 1]
    rows, slots = verify_rows(tree, ctx_lens, bs)
    got = attended(tree, rows, slots, bs)
    want = [set(range(c + j + 1)) for c in ctx_lens for j in range(K + 1)]
    crossing = [c % bs + j >= bs for c in ctx_lens for j in range(K + 1)]
    assert any(crossing)
    for r, (g, w) in enumerate(zip(got, want)):
        if tree.port:
            assert g == w, (r, ctx_lens[r // (K + 1)], r % (K + 1))
        else:  # vllm-gaudi's rows are right exactly where they stay in the first token's block
            assert (g == w) is not crossing[r], r


def test_other_models_keep_the_stock_tables(tree):
    rows, _ = verify_rows(tree, [2, 3], 4, model_type="gemma3")
    assert rows == [list(range(1000, 1001))] * (K + 1) + [list(range(2000, 2001))] * (K + 1)
