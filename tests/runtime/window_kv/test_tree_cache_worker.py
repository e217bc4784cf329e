"""HPUWorker.determine_available_memory of the vllm-gaudi tree named by GAUDI_FIXES_ROOT (skipped
without it), with and without the port unit beam-window-kv-cache, over Beam's window-sized specs.

The tree's own method runs from the file up to its fake-HPU return: it builds a one-block dummy K/V
cache per layer from the runner's specs and binds them with vLLM's bind_kv_cache into a real
VllmConfig's forward context of 52 real Attention layers. Stand-ins: torch with device "hpu" read
as the host (the dummy caches are plain zeros), is_fake_hpu answering True (the host has no
device memory to measure), the runner (its specs and the HPU backend's get_kv_cache_shape).
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from beam_hpu.runtime.window_kv import groups as wkv
from tests.support.gaudi.source import load
from tests.support.gaudi.tree import gaudi_root, port_tree_fixture
from tests.support.gaudi.window_kv_cache import (
    BS,
    HEAD,
    HEADS,
    WINDOW,
    runner_for_kv_init,
    runner_module_globals,
    tree_defragmenter_class,
    tree_kv_cache_shape,
    window_kv_config,
)
from tests.support.window_kv.configs import beam_layer_windows

pytestmark = pytest.mark.gaudi_tree
tree = port_tree_fixture("module", ("stock", "port"))

WORKER = "vllm_gaudi/v1/worker/hpu_worker.py"
FAKE_HPU_BYTES = 4 * 2**30  # what the tree's method returns on a fake HPU


class HostDeviceTorch:
    """torch whose tensor factories put a device="hpu" tensor on the host."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, **kwargs)

    @staticmethod
    def ones(*args, device=None, **kwargs):
        return torch.ones(*args, **kwargs)


def worker_profile(tree, config, specs):
    globals_ = {**runner_module_globals(tree.root / WORKER), "torch": HostDeviceTorch(), "is_fake_hpu": lambda: True,
                "logger": logging.getLogger("gaudi_tree_worker")}
    method = load(tree.root / WORKER, "determine_available_memory", "HPUWorker", **globals_)
    worker = SimpleNamespace(
        vllm_config=config, model_config=SimpleNamespace(use_mla=False),
        model_runner=SimpleNamespace(get_kv_cache_spec=lambda: specs,
                                     attn_backend=SimpleNamespace(get_kv_cache_shape=tree_kv_cache_shape(tree.root))))
    return method(worker)


def test_worker_profiles_window_sized_layers_like_full_ones(tree, beam_config, unbound):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    full = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    specs = {n: wkv.window_kv_spec(full, w) for n, w in beam_layer_windows(WINDOW).items()}
    if not tree.port:
        with pytest.raises(NotImplementedError):  # the stock profile knows FullAttentionSpec and MambaSpec only
            worker_profile(tree, beam_config, specs)
        return
    assert worker_profile(tree, beam_config, specs) == FAKE_HPU_BYTES
    forward = beam_config.compilation_config.static_forward_context
    for name in specs:  # every layer, sliding or full, got the same one-block dummy K/V cache
        key, value, key_scales, value_scales = forward[name].kv_cache
        assert key.shape == value.shape == (BS, HEADS, HEAD) and key.dtype == torch.bfloat16
        assert key_scales is None and value_scales is None


def test_worker_profile_of_full_specs_is_the_same_in_both_trees(tree, beam_config, unbound):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    full = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    specs = {n: full for n in beam_layer_windows(WINDOW)}
    assert worker_profile(tree, beam_config, specs) == FAKE_HPU_BYTES
    forward = beam_config.compilation_config.static_forward_context
    assert {forward[n].kv_cache[0].shape for n in specs} == {(BS, HEADS, HEAD)}


class NoMemoryProfiler:
    """HabanaMemoryProfiler without a device to measure: a context that reports nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def get_summary_string(self):
        return "(not measured on the host)"


@pytest.mark.parametrize("tree", ["port"], indirect=True)  # the stock tree cannot allocate it (test_tree_cache.py)
def test_wake_up_rebuilds_the_cache_and_hands_the_defragmenter_each_buffer_once(tree, beam_config, unbound):
    # Sleep mode's wake-up re-initialises the KV cache through the runner's own initialize_kv_cache
    # and builds a new OnlineDefragmenter: with a window-sized cache it gets the 9 buffers.
    kc = window_kv_config(beam_config)
    runner, initialize = runner_for_kv_init(tree, beam_config, runner_module_globals(tree.runner))
    runner.initialize_kv_cache = initialize.__get__(runner)
    globals_ = {**runner_module_globals(tree.root / WORKER), "HabanaMemoryProfiler": NoMemoryProfiler,
                "OnlineDefragmenter": tree_defragmenter_class(gaudi_root()),
                "htorch": SimpleNamespace(utils=SimpleNamespace(internal=SimpleNamespace(is_lazy=lambda: False))),
                "torch": SimpleNamespace(hpu=SimpleNamespace(synchronize=lambda: None))}
    wake_up = load(tree.root / WORKER, "wake_up", "HPUWorker", **globals_)
    worker = SimpleNamespace(model_runner=runner, kv_cache_sleeping=True, kv_cache_config=kc, model_sleeping=False,
                             model_config=SimpleNamespace(enforce_eager=False))
    wake_up(worker, ["kv_cache"])
    assert not worker.kv_cache_sleeping
    assert len(runner.kv_caches) == 52
    held = runner.defragmenter.kv_caches
    assert len(held) == 9 and len({c[0].untyped_storage().data_ptr() for c in held}) == 9
    # The public tree's own wake_up (without the unit) hands it every layer's entry: 52.
    stock_wake_up = load(gaudi_root() / WORKER, "wake_up", "HPUWorker", **globals_)
    runner.kv_caches, worker.kv_cache_sleeping = [], True
    stock_wake_up(worker, ["kv_cache"])
    assert len(runner.defragmenter.kv_caches) == 52
