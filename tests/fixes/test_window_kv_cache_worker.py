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
from gaudi_source import load
from test_fixes_gaudi import pytestmark  # noqa: F401  (skip without GAUDI_FIXES_ROOT)
from test_window_kv_cache_tree import (  # noqa: F401  (fixtures)
    BS,
    HEAD,
    HEADS,
    WINDOW,
    beam_config,
    runner_module_globals,
    tree,
    tree_kv_cache_shape,
    unbound,
)

from beam_hpu.hpu import window_kv as wkv
from tests.hpu.test_window_kv_vllm import beam_layer_windows

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
