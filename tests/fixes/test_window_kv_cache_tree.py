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
import logging
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gaudi_source import RUNNER, find_def, load
from test_fixes_gaudi import ROOT_ENV, copy_tree, pytestmark  # noqa: F401  (skip without GAUDI_FIXES_ROOT)
from test_port_patches import PORT_UNITS, RUNNER_CLS, apply, gaudi_units
from test_window_kv_defrag import tree_defragmenter_class

from beam_hpu.runtime.window_kv import groups as wkv
from fixes.engine import EXIT_OK
from fixes.profile import load_profile
from tests.runtime.window_kv.test_groups_vllm import beam_layer_windows

pytest.importorskip("vllm")

NUM_LAYERS, WINDOW, BS, HEADS, HEAD = 52, 512, 128, 1, 16
NUM_BLOCKS = 6
INPUT_BATCH = "vllm_gaudi/v1/worker/hpu_input_batch.py"
PAGED = "vllm_gaudi/attention/ops/hpu_paged_attn.py"


@pytest.fixture(scope="module", params=["stock", "port"])
def tree(request, tmp_path_factory):
    root, checkouts = copy_tree(tmp_path_factory.mktemp(request.param) / "site")
    only = gaudi_units(load_profile("port-beam-1-0-public-main"))
    if request.param == "stock":
        only = [n for n in only if n not in PORT_UNITS]
    assert apply(root, checkouts, only=only).exit_code == EXIT_OK
    return SimpleNamespace(root=root, port=request.param == "port", runner=root / RUNNER)


# ---------------------------------------------------------------- Beam's layers in a vLLM config

def beam_vllm_config(block_size: int = BS, window: int = WINDOW):
    """A VllmConfig whose forward context holds Beam's 52 attention layers (real Attention)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    config = VllmConfig()
    config.cache_config.block_size = block_size
    config.cache_config.kv_cache_layout = "LBHNC"  # vLLM's identity layout (the engine core resolves it)
    with set_current_vllm_config(config):
        for name, w in beam_layer_windows(window).items():
            Attention(4, HEAD, 0.25, num_kv_heads=HEADS, cache_config=config.cache_config,
                      per_layer_sliding_window=w, prefix=name)
    return config


@pytest.fixture(scope="module")
def beam_config():
    return beam_vllm_config()


def runner_module_globals(path: Path) -> dict:
    """What the runner file's top-level imports bind, for those that resolve without vllm_gaudi
    or Habana (vLLM 0.30, torch, the standard library); a name the file imports from a module
    vLLM 0.30 lacks is left out, so a method needing it fails by name."""
    names = {"__builtins__": __builtins__}
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
        if (module or "").startswith(("vllm_gaudi", "habana_frameworks")):
            continue
        try:
            exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), names)
        except ImportError:
            continue
    names["logger"] = logging.getLogger("gaudi_tree_runner")
    names["htorch"] = SimpleNamespace(hpu=SimpleNamespace(synchronize=lambda: None))
    return names


def runner_method(tree, name: str, globals_: dict):
    return load(tree.runner, name, RUNNER_CLS, **globals_)


def kv_cache_specs(tree, config, model_type: str, globals_: dict, dtype=torch.bfloat16) -> dict:
    runner = SimpleNamespace(vllm_config=config, kv_cache_dtype=dtype, shared_kv_cache_layers={},
                             model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type)))
    return runner_method(tree, "get_kv_cache_spec", globals_)(runner)


def kv_cache_config(config, specs: dict, num_blocks: int = NUM_BLOCKS):
    """What vLLM's engine core makes of the specs: its own grouping and layout."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

    groups = get_kv_cache_groups(config, dict(specs))
    page = next(iter(specs.values())).page_size_bytes
    bytes_per_block = max(len(g.layer_names) for g in groups) * page
    return get_kv_cache_config_from_groups(config, groups, num_blocks * bytes_per_block)


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

def tree_input_batch_class(root: Path):
    """The tree's InputBatch, its file executed as a module (its dataclasses look their module up
    in sys.modules) without its one vllm_gaudi import (host-to-device copy helpers it calls only
    when a batch goes to the device)."""
    path = root / INPUT_BATCH
    tree = ast.parse(path.read_text())
    tree.body = [n for n in tree.body
                 if not (isinstance(n, ast.ImportFrom) and (n.module or "").startswith("vllm_gaudi"))]
    module = types.ModuleType(f"gaudi_tree_input_batch_{abs(hash(str(root)))}")
    module.async_h2d_copy = module.async_h2d_update = None
    sys.modules[module.__name__] = module
    exec(compile(tree, str(path), "exec"), module.__dict__)
    return module.InputBatch


def tree_kv_cache_shape(root: Path):
    tree = ast.parse((root / PAGED).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HPUPagedAttention")
    fn = find_def(ast.Module(body=cls.body, type_ignores=[]), "get_kv_cache_shape")
    fn.decorator_list = []
    namespace: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(root / PAGED), "exec"), namespace)
    return namespace["get_kv_cache_shape"]


def runner_for_kv_init(tree, config, globals_: dict, into=None, block_size: int = BS):
    """The runner fields initialize_kv_cache and may_reinitialize_input_batch read, as a fresh
    HPUModelRunner has them for Beam (no Mamba, no encoder-only layers, no KV transfer), with
    the tree's InputBatch of one block table and the tree's own helper methods bound. `into`: a
    runner object to give the fields it lacks (and the methods) instead of a new namespace."""
    BS = block_size  # noqa: N806  (the module's figure unless told)
    input_batch_cls = tree_input_batch_class(tree.root)
    globals_ = {**globals_, "InputBatch": input_batch_cls}

    max_reqs = getattr(into, "max_num_reqs", 4)

    def new_batch(block_sizes):
        return input_batch_cls(max_num_reqs=max_reqs, max_model_len=4096, max_num_batched_tokens=512, device="cpu",
                               pin_memory=False, vocab_size=64, block_sizes=block_sizes,
                               kernel_block_sizes=block_sizes)

    runner = SimpleNamespace(
        vllm_config=config, cache_config=config.cache_config, model_config=SimpleNamespace(
            use_mla=False, get_vocab_size=lambda: 64), max_num_reqs=max_reqs, max_model_len=4096, max_encoder_len=0,
        max_num_tokens=512, device="cpu", pin_memory=False, is_pooling_model=False,
        _compact_gdn_group_ids=set(), _compact_gdn_group_offset={}, _compact_gdn_enabled=False,
        shared_kv_cache_layers={}, runner_only_attn_layers=set(), num_mamba_like_layers=0, num_gdn=0,
        use_hybrid_cache=False, use_naive_mamba_cache_sharing=False, _original_max_num_seqs=4,
        attn_groups=["set: initialize_attn_backend returns at once"], enable_bucketing=False,
        attn_block_size=BS, block_size=BS, kv_caches=[],
        attn_backend=SimpleNamespace(get_kv_cache_shape=tree_kv_cache_shape(tree.root)))
    if into is not None:
        for name, value in vars(runner).items():
            if not hasattr(into, name):
                setattr(into, name, value)
        runner = into
    runner.input_batch = new_batch([BS])
    for name in ("maybe_add_kv_sharing_layers_to_kv_cache_groups", "may_add_encoder_only_layers_to_kv_cache_config",
                 "initialize_attn_backend", "may_reinitialize_input_batch"):
        setattr(runner, name, runner_method(tree, name, globals_).__get__(runner))
    return runner, runner_method(tree, "initialize_kv_cache", globals_)


def window_kv_config(config):
    """The KVCacheConfig vLLM makes of Beam's window-sized specs (window_kv_spec per layer, what
    the port's get_kv_cache_spec returns: test above)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    full = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    return kv_cache_config(config, {n: wkv.window_kv_spec(full, w) for n, w in beam_layer_windows(WINDOW).items()})


@pytest.fixture
def unbound(beam_config):
    yield
    for layer in beam_config.compilation_config.static_forward_context.values():
        layer.kv_cache = torch.tensor([])


def test_tree_allocates_nine_shared_buffers_and_binds_each_layer(tree, beam_config, unbound):
    globals_ = runner_module_globals(tree.runner)
    kc = window_kv_config(beam_config)
    runner, initialize = runner_for_kv_init(tree, beam_config, globals_)
    if not tree.port:
        # Without the unit the tree has no allocation for it: on vLLM 0.30 its stock path reads
        # KVCacheTensor.shared_by, a field 0.30 no longer has; its single block table stays.
        with pytest.raises(AttributeError, match="shared_by"):
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
    with pytest.raises(AttributeError, match="shared_by"):
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
    defrag_cls = tree_defragmenter_class(Path(ROOT_ENV))
    statements = warmup_defragmenter_statements(tree)
    assert len(statements) == 2  # before the warm-up and the re-created one after it
    buffers = wkv.shared_buffer_layers([g.layer_names for g in kc.kv_cache_groups])
    for statement in statements:
        namespace = {"__builtins__": __builtins__, "self": runner, "OnlineDefragmenter": defrag_cls}
        exec(compile(ast.Module(body=[statement], type_ignores=[]), str(tree.runner), "exec"), namespace)
        held = runner.defragmenter.kv_caches
        assert len(held) == 9
        assert len({c[0].untyped_storage().data_ptr() for c in held}) == 9
    port_defragmenter = runner.defragmenter
    # Without the unit (the public tree's own statements) it holds every layer's entry: 52, so
    # each shared buffer 5 or 6 times (swapped back: tests/fixes/test_window_kv_defrag.py).
    for statement in warmup_defragmenter_statements(SimpleNamespace(runner=Path(ROOT_ENV) / RUNNER)):
        namespace = {"__builtins__": __builtins__, "self": runner, "OnlineDefragmenter": defrag_cls}
        exec(compile(ast.Module(body=[statement], type_ignores=[]), RUNNER, "exec"), namespace)
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
    defrag_cls = tree_defragmenter_class(Path(ROOT_ENV))
    caches = [(torch.zeros(8, 1, 1), torch.zeros(8, 1, 1), None, None) for _ in range(3)]
    for with_field in (False, True):
        runner = SimpleNamespace(is_pooling_model=False, kv_caches=caches, block_size=4)
        if with_field:
            runner.beam_window_kv_block_sizes = None
        for statement in warmup_defragmenter_statements(tree):
            namespace = {"__builtins__": __builtins__, "self": runner, "OnlineDefragmenter": defrag_cls}
            exec(compile(ast.Module(body=[statement], type_ignores=[]), str(tree.runner), "exec"), namespace)
            held = runner.defragmenter.kv_caches  # the tree keeps its own tuple of what it is given
            assert len(held) == 3 and all(a is b for a, b in zip(held, caches))
