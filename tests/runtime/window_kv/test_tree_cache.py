"""The window-sized KV cache on the vllm-gaudi tree named by GAUDI_FIXES_ROOT (skipped without it),
with and without the port unit beam-window-kv-cache, on CPU.

Beam's 52 attention layers are real vLLM 0.30 Attention modules (9 full, 43 with a 512-token
sliding window, Beam-1.0's layer_types) registered in a real VllmConfig's forward context. The
tree's own HPUModelRunner.get_kv_cache_spec gives their specs; vLLM's own get_kv_cache_groups and
get_kv_cache_config_from_groups turn them into the KVCacheConfig the engine core hands the worker;
the tree's own initialize_kv_cache (with its may_reinitialize_input_batch, the tree's InputBatch,
the HPU backend's get_kv_cache_shape and vLLM's bind_kv_cache) allocates and binds it; the tree's
own OnlineDefragmenter is built by the tree's own warmup_model statements.

Stand-ins, each for something without a CPU form or outside this unit: htorch.hpu.synchronize (a
no-op, the host has nothing in flight), the runner's scalar state (a namespace with the fields
these methods read), and initialize_attn_backend, which is skipped by the tree's own early return
(`attn_groups` already set): building attention metadata builders is not this unit's.
"""
from __future__ import annotations

import ast
from types import SimpleNamespace

import pytest
import torch

from beam_hpu.runtime.window_kv import groups as wkv
from tests.support.gaudi.source import RUNNER, RUNNER_CLS, find_def, run_statements
from tests.support.gaudi.tree import gaudi_root, port_tree_fixture
from tests.support.gaudi.window_kv_cache import (
    BS,
    HEAD,
    HEADS,
    NUM_LAYERS,
    WINDOW,
    kv_cache_config,
    kv_cache_specs,
    runner_for_kv_init,
    runner_module_globals,
    stock_allocation_fails_on_shared_by,
    tree_defragmenter_class,
    window_kv_config,
)
from tests.support.window_kv.configs import beam_layer_windows

pytestmark = pytest.mark.gaudi_tree
pytest.importorskip("vllm")

tree = port_tree_fixture("module", ("stock", "port"))


# ---------------------------------------------------------------- get_kv_cache_spec

@pytest.mark.parametrize("switch, model_type", [("1", "beam"), ("0", "beam"), ("1", "llama")])
def test_tree_gives_sliding_specs_for_beam_only_under_the_switch(tree, beam_config, monkeypatch, switch, model_type):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    monkeypatch.setenv("BEAM_WINDOW_KV", switch)
    globals_ = runner_module_globals(tree.runner)
    specs = kv_cache_specs(tree, beam_config, model_type, globals_)
    assert list(specs) == list(beam_layer_windows(WINDOW))
    acting = tree.port and switch == "1" and model_type == "beam"
    if not acting:  # exactly the stock specs: FullAttentionSpec everywhere, one group
        assert all(type(s) is FullAttentionSpec for s in specs.values())
        assert len(kv_cache_config(beam_config, specs).kv_cache_groups) == 1
        return
    sliding = {n for n, s in specs.items() if type(s) is SlidingWindowSpec}
    assert sliding == {n for n, w in beam_layer_windows(WINDOW).items() if w is not None}
    assert len(sliding) == 43 and {specs[n].sliding_window for n in sliding} == {WINDOW}
    assert {(s.block_size, s.num_kv_heads, s.head_size, s.dtype) for s in specs.values()} == {
        (BS, HEADS, HEAD, torch.bfloat16)}
    kc = kv_cache_config(beam_config, specs)
    kinds = sorted(type(g.kv_cache_spec).__name__ for g in kc.kv_cache_groups)
    assert kinds == ["FullAttentionSpec"] + ["SlidingWindowSpec"] * 5
    assert kc == window_kv_config(beam_config)  # what the allocation tests below are handed


def test_switch_off_specs_are_the_stock_trees(tree, beam_config, monkeypatch):
    # The port's get_kv_cache_spec with the switch off returns what the stock tree's returns.
    monkeypatch.setenv("BEAM_WINDOW_KV", "0")
    globals_ = runner_module_globals(tree.runner)
    specs = kv_cache_specs(tree, beam_config, "beam", globals_)
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    stock = {n: FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
             for n in beam_layer_windows(WINDOW)}
    assert specs == stock


# ---------------------------------------------------------------- initialize_kv_cache

def test_tree_allocates_nine_shared_buffers_and_binds_each_layer(tree, beam_config, unbound):
    globals_ = runner_module_globals(tree.runner)
    kc = window_kv_config(beam_config)
    runner, initialize = runner_for_kv_init(tree, beam_config, globals_)
    if not tree.port:
        # Without the unit the tree has no allocation for it: on vLLM 0.30 its stock path reads
        # KVCacheTensor.shared_by, a field 0.30 no longer has; its single block table stays.
        with stock_allocation_fails_on_shared_by():
            initialize(runner, kc)
        assert len(runner.input_batch.block_table.block_tables) == 1
        return
    initialize(runner, kc)
    groups = [g.layer_names for g in kc.kv_cache_groups]
    buffers = wkv.shared_buffer_layers(groups)
    assert len(buffers) == 9
    forward = beam_config.compilation_config.static_forward_context
    caches = {name: forward[name].kv_cache for name in beam_layer_windows(WINDOW)}
    storages = {}
    for j, names in enumerate(buffers):
        key, value, key_scales, value_scales = caches[names[0]]
        assert key_scales is None and value_scales is None
        # vLLM's pool and the pad block, in the HPU flat layout [(blocks + 1) * bs, heads, head]
        assert key.shape == value.shape == ((kc.num_blocks + 1) * BS, HEADS, HEAD)
        assert key.dtype == torch.bfloat16
        for name in names:
            assert caches[name] is caches[names[0]]  # the same tuple for every sharer
        storages[j] = key.untyped_storage().data_ptr()
    assert len(set(storages.values())) == 9  # nine distinct K buffers, not 52
    assert runner._PAD_BLOCK_ID == kc.num_blocks and runner._PAD_SLOT_ID == kc.num_blocks * BS
    # The runner's list: one entry per layer in layer order (vLLM's bind_kv_cache), 9 distinct.
    assert len(runner.kv_caches) == NUM_LAYERS
    assert [c is caches[n] for c, n in zip(runner.kv_caches, beam_layer_windows(WINDOW))] == [True] * NUM_LAYERS
    assert len(wkv.distinct_kv_caches(runner.kv_caches)) == 9
    # A write through one layer's cache is read by the layers sharing its buffer, and only them.
    writer = buffers[3][1]
    caches[writer][0][2 * BS + 5] = 7.0
    seen = {name for name in caches if caches[name][0][2 * BS + 5].eq(7.0).all()}
    assert seen == set(buffers[3])
    # One block table per group, each of the group's block size.
    tables = runner.input_batch.block_table.block_tables
    assert len(tables) == len(groups) == 6
    assert [t.block_size for t in tables] == [g.kv_cache_spec.block_size for g in kc.kv_cache_groups] == [BS] * 6
    assert runner.beam_window_kv_block_sizes == [BS] * 6


def test_full_attention_config_takes_the_stock_path_in_both_trees(tree, beam_config, unbound):
    """Switch off (every spec full attention): the port's initialize_kv_cache does exactly what
    the stock tree's does. On vLLM 0.30 that is to fail in the stock allocation on
    KVCacheTensor.shared_by (public main 091bbadd reads a field 0.30 dropped); the port adds
    nothing before it but the None it keeps for the window-sized block sizes."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    globals_ = runner_module_globals(tree.runner)
    specs = {n: FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
             for n in beam_layer_windows(WINDOW)}
    kc = kv_cache_config(beam_config, specs)
    runner, initialize = runner_for_kv_init(tree, beam_config, globals_)
    batch = runner.input_batch
    with stock_allocation_fails_on_shared_by():
        initialize(runner, kc)
    assert runner.input_batch is batch  # not re-initialised: one block table
    assert getattr(runner, "beam_window_kv_block_sizes", None) is None


# ---------------------------------------------------------------- the defragmenter

def warmup_defragmenter_statements(tree) -> list[ast.If]:
    """warmup_model's `if not self.is_pooling_model:` statements that build the defragmenter."""
    node = find_def(ast.parse(tree.runner.read_text()), "warmup_model", RUNNER_CLS)
    return [n for n in ast.walk(node) if isinstance(n, ast.If) and ast.unparse(n.test) == "not self.is_pooling_model"
            and "OnlineDefragmenter" in ast.unparse(n)]


@pytest.mark.parametrize("tree", ["port"], indirect=True)  # the stock tree cannot allocate it (above)
def test_defragmenter_gets_each_shared_buffer_once_and_moves_contents(tree, beam_config, unbound):
    globals_ = runner_module_globals(tree.runner)
    kc = window_kv_config(beam_config)
    runner, initialize = runner_for_kv_init(tree, beam_config, globals_)
    initialize(runner, kc)
    defrag_cls = tree_defragmenter_class(gaudi_root())
    statements = warmup_defragmenter_statements(tree)
    assert len(statements) == 2  # before the warm-up and the re-created one after it
    buffers = wkv.shared_buffer_layers([g.layer_names for g in kc.kv_cache_groups])
    for statement in statements:
        run_statements([statement], tree.runner, {"self": runner, "OnlineDefragmenter": defrag_cls})
        held = runner.defragmenter.kv_caches
        assert len(held) == 9
        assert len({c[0].untyped_storage().data_ptr() for c in held}) == 9
    port_defragmenter = runner.defragmenter
    # Without the unit (the public tree's own statements) it holds every layer's entry: 52, so
    # each shared buffer 5 or 6 times (swapped back: test_tree_defrag.py).
    for statement in warmup_defragmenter_statements(SimpleNamespace(runner=gaudi_root() / RUNNER)):
        run_statements([statement], RUNNER, {"self": runner, "OnlineDefragmenter": defrag_cls})
        assert len(runner.defragmenter.kv_caches) == NUM_LAYERS
    # Swapping through what it holds moves each block's keys once: block 5's contents follow its id.
    forward = beam_config.compilation_config.static_forward_context
    for j, names in enumerate(buffers):
        key = forward[names[0]].kv_cache[0]
        for b in range(kc.num_blocks + 1):
            key[b * BS:(b + 1) * BS] = 100.0 * j + b
    # The tree's swap (its cache_utils, an exchange with prefix caching) over what it holds.
    defrag = port_defragmenter
    srcs, dsts = torch.tensor([5]), torch.tensor([1])
    for part in (0, 1):
        defrag.cache_utils(srcs, dsts, [cache[part] for cache in defrag.kv_caches], BS)
    for j, names in enumerate(buffers):
        key = forward[names[0]].kv_cache[0]
        assert key[1 * BS].eq(100.0 * j + 5).all() and key[5 * BS].eq(100.0 * j + 1).all()


def test_defragmenter_keeps_the_runners_list_when_off(tree):
    # Switch off (no window-sized block sizes): the defragmenter holds every entry of the runner's
    # list (here three layers' caches), as stock.
    defrag_cls = tree_defragmenter_class(gaudi_root())
    caches = [(torch.zeros(8, 1, 1), torch.zeros(8, 1, 1), None, None) for _ in range(3)]
    for with_field in (False, True):
        runner = SimpleNamespace(is_pooling_model=False, kv_caches=caches, block_size=4)
        if with_field:
            runner.beam_window_kv_block_sizes = None
        for statement in warmup_defragmenter_statements(tree):
            run_statements([statement], tree.runner, {"self": runner, "OnlineDefragmenter": defrag_cls})
            held = runner.defragmenter.kv_caches  # the tree keeps its own tuple of what it is given
            assert len(held) == 3 and all(a is b for a, b in zip(held, caches))
