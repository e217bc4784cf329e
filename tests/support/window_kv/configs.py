"""Beam's 52 attention layers as vLLM 0.30 groups them: the KVCacheConfig the engine core hands
the worker, for a window-sized cache (1 full + 5 sliding groups) or a plain one (one full group)."""
from __future__ import annotations

import torch

NUM_LAYERS = 52


def beam_layer_windows(window: int) -> dict[str, int | None]:
    # Beam-1.0's layer_types: full attention on every 6th layer and the last one.
    return {f"model.layers.{i}.self_attn.attn": None if (i + 1) % 6 == 0 or i == NUM_LAYERS - 1 else window
            for i in range(NUM_LAYERS)}


def vllm_config():
    from vllm.config import VllmConfig

    config = VllmConfig()
    config.cache_config.kv_cache_layout = "LBHNC"  # vLLM's identity layout (the engine core resolves it)
    return config


def beam_kv_cache_config(bs: int, window: int, num_blocks: int, dtype=torch.bfloat16):
    """(layer -> spec, the KVCacheConfig) of Beam's layers with window-sized sliding specs."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from beam_hpu.runtime.window_kv import groups as wkv

    full = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=128, dtype=dtype)
    specs = {name: wkv.window_kv_spec(full, w) for name, w in beam_layer_windows(window).items()}
    config = vllm_config()
    groups = get_kv_cache_groups(config, dict(specs))
    bytes_per_block = max(len(g.layer_names) for g in groups) * full.page_size_bytes
    return specs, get_kv_cache_config_from_groups(config, groups, num_blocks * bytes_per_block)


def full_only_config(bs: int, num_blocks: int, head_size: int = 128):
    """Every layer full attention (the switch off, or another model): one group."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    full = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=head_size, dtype=torch.bfloat16)
    config = vllm_config()
    groups = get_kv_cache_groups(config, {name: full for name in beam_layer_windows(0)})
    return get_kv_cache_config_from_groups(config, groups, num_blocks * NUM_LAYERS * full.page_size_bytes)
