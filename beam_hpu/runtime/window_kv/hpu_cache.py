"""The window-sized KV cache on a Gaudi runner: when it is on, which spec each layer gets, how
the runner allocates and binds vLLM's aliased groups, and what the defragmenter is handed.

The port unit beam-window-kv-cache wires these into vllm-gaudi's HPUModelRunner and HPUWorker:

- `get_kv_cache_spec`: with BEAM_WINDOW_KV on and model type beam (`hpu_window_kv_enabled`), every
  decoder attention layer with a sliding window gets vLLM's `SlidingWindowSpec`
  (`window_kv_cache_specs`), so vLLM's manager forms Beam's 1 full + 5 sliding groups.
- `initialize_kv_cache`: the groups' specs say whether the cache is window-sized
  (`window_kv_block_sizes`: one block table per group); vLLM 0.30 then lays every group over one
  allocation from byte 0 (`KVCacheTensor.layers` at `offset + l * layer_stride`), so the runner
  allocates one K/V buffer per group position, not per layer (`window_kv_buffers`,
  `shared_kv_caches`), each with the runner's pad block after vLLM's pool.
- the OnlineDefragmenter gets each shared buffer once (`defragmenter_caches`).

Off, or for any other model, none of them changes anything: the stock specs, the stock
allocation, the runner's own cache list. The per-group rules (slots, tables, windows) are
`beam_hpu.runtime.window_kv.groups`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

from beam_hpu.runtime.window_kv.groups import allocation_windows, distinct_kv_caches, shared_buffer_layers, window_kv_spec
from beam_hpu.names import MODEL_TYPE
from beam_hpu.settings import switches


# ---------------------------------------------------------------- the switch

def window_kv_enabled(env: Mapping[str, str] | None = None) -> bool:
    """BEAM_WINDOW_KV: whether Beam's sliding layers get a window-sized KV cache."""
    return switches.current("BEAM_WINDOW_KV", env)


def hpu_window_kv_enabled(model_type: str | None, env: Mapping[str, str] | None = None) -> bool:
    """What a Gaudi runner's get_kv_cache_spec acts on: the switch, for model type beam only
    (any other model keeps vllm-gaudi's full-attention specs whatever the switch says)."""
    on = window_kv_enabled(env)  # read (and validated) for every model
    return on and model_type == MODEL_TYPE


# ---------------------------------------------------------------- specs

def window_kv_cache_specs(specs: Mapping[str, Any], layer_windows: Mapping[str, int | None]) -> dict[str, Any]:
    """The runner's specs with every plain full-attention layer that has a sliding window given
    `window_kv_spec` for the window it is allocated for (`allocation_windows`: a drafter's odd
    window stays full, so the grouping stays 1 full + 5 sliding). Layers with any other spec
    (MLA, Mamba, ...) and layers without a window keep theirs."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    plain = {name for name, spec in specs.items() if type(spec) is FullAttentionSpec}
    windows = allocation_windows({name: layer_windows.get(name) for name in plain})
    return {name: window_kv_spec(spec, windows[name]) if name in plain else spec for name, spec in specs.items()}


def profiled_as_attention(spec) -> bool:
    """Whether the worker's memory profile gives a layer the attention layout (a K and a V cache
    of one block): full attention as vllm-gaudi does, and a window-sized layer, whose cache has
    the same shape."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    return isinstance(spec, (FullAttentionSpec, SlidingWindowSpec))


# ---------------------------------------------------------------- groups and buffers

def _window_kv_groups(kv_cache_config) -> bool:
    """True when vLLM's config carries window-sized groups (one SlidingWindowSpec group or more),
    after checking every group is plain full or sliding attention (what the shared-buffer
    allocation below serves)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    if not any(type(s) is SlidingWindowSpec for s in specs):
        return False
    odd = sorted({type(s).__name__ for s in specs if type(s) not in (FullAttentionSpec, SlidingWindowSpec)})
    if odd:
        raise ValueError(f"a window-sized KV cache serves full and sliding attention groups only, not {odd}")
    return True


def window_kv_block_sizes(kv_cache_config) -> list[int] | None:
    """Each group's block size (the InputBatch keeps one block table per group) when the cache
    is window-sized; None otherwise (the runner's single table stays)."""
    if not _window_kv_groups(kv_cache_config):
        return None
    return [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]


def aliased_layers(kv_cache_tensors: Sequence) -> list[list[str]]:
    """vLLM 0.30's layout read back: layers whose pages start at the same byte of the backing
    allocation (layer l of a KVCacheTensor at offset + l * layer_stride), in order of that byte.
    Groups overlay each other, so each list is the layers that must share one device buffer."""
    by_start: dict[int, list[str]] = {}
    for tensor in kv_cache_tensors:
        for index, name in enumerate(tensor.layers):
            by_start.setdefault(tensor.offset + index * tensor.layer_stride, []).append(name)
    return [by_start[start] for start in sorted(by_start)]


@dataclass(frozen=True)
class SharedBuffers:
    """How a runner allocates a window-sized cache: `layers[j]` share K/V buffer j, each of
    `num_blocks` + 1 blocks (vLLM's pool, then the runner's pad block, id `num_blocks`), with
    the geometry of `spec` (every group's: same block size, heads, head size and dtype)."""

    layers: list[list[str]]
    num_blocks: int
    spec: Any

    @property
    def pad_block_id(self) -> int:
        return self.num_blocks

    def device_bytes(self) -> int:
        """What the buffers take on the device: K and V pages of every block, pad block included."""
        return len(self.layers) * (self.num_blocks + 1) * self.spec.page_size_bytes


def _geometry(spec) -> tuple:
    return (spec.block_size, spec.num_kv_heads, spec.head_size, spec.head_size_v, spec.dtype, spec.page_size_bytes)


def dynamic_kv_scales(dtype, env: Mapping[str, str]) -> bool:
    """vllm-gaudi's rule for per-block dynamic FP8 KV scales (its allocation creates scale
    tensors): an FP8 cache with QUANT_CONFIG and VLLM_DYNAMIC_KV_QUANT both set."""
    import torch

    return dtype == torch.float8_e4m3fn and env.get("QUANT_CONFIG") is not None \
        and env.get("VLLM_DYNAMIC_KV_QUANT") is not None


def window_kv_buffers(kv_cache_config, env: Mapping[str, str] | None = None) -> SharedBuffers:
    """The shared buffers for vLLM's window-sized KVCacheConfig: one per group position j, shared
    by the j-th layer of every group (`window_kv.shared_buffer_layers`), which must be exactly
    the layers vLLM's own layout places at the same bytes (`aliased_layers`); one geometry for
    every group; vLLM's tensors large enough for the pool. Dynamic FP8 KV scales
    (`dynamic_kv_scales` in `env`, the runner's environment) are refused: their scale tensors
    would need the same sharing, which nothing here builds or tests."""
    groups = kv_cache_config.kv_cache_groups
    buffers = shared_buffer_layers([g.layer_names for g in groups])
    vllm_buffers = aliased_layers(kv_cache_config.kv_cache_tensors)
    if sorted(map(sorted, buffers)) != sorted(map(sorted, vllm_buffers)):
        raise ValueError(f"vLLM's KV layout aliases {vllm_buffers}, the groups' positions give {buffers}")
    geometries = {_geometry(g.kv_cache_spec) for g in groups}
    if len(geometries) != 1:
        raise ValueError(f"KV-cache groups of different geometry share buffers: {sorted(geometries, key=str)}")
    spec = groups[0].kv_cache_spec
    if dynamic_kv_scales(spec.dtype, env or {}):
        raise NotImplementedError("a window-sized KV cache with dynamic FP8 KV scales (QUANT_CONFIG with "
                                  "VLLM_DYNAMIC_KV_QUANT) is not built: set BEAM_WINDOW_KV=0")
    num_blocks = kv_cache_config.num_blocks
    needed = len(buffers) * num_blocks * spec.page_size_bytes
    short = [t.layers[0] for t in kv_cache_config.kv_cache_tensors if t.size < needed]
    if short:
        raise ValueError(f"vLLM's tensors of {short} hold fewer than {num_blocks} blocks of {len(buffers)} layers")
    return SharedBuffers(layers=buffers, num_blocks=num_blocks, spec=spec)


def shared_kv_caches(buffers: Sequence[Sequence[str]], make_cache: Callable[[], tuple]) -> dict[str, tuple]:
    """Layer name -> its cache: `make_cache()` called once per buffer, the same object bound to
    every layer sharing it (so a write through one layer is read through the others, and only
    through those)."""
    caches: dict[str, tuple] = {}
    for layers in buffers:
        cache = make_cache()
        for name in layers:
            caches[name] = cache
    return caches


def defragmenter_caches(kv_caches: list, window_kv: bool) -> list:
    """What the runner hands vllm-gaudi's OnlineDefragmenter: its per-layer list unchanged (the
    same object) unless the cache is window-sized, then each shared buffer once
    (`window_kv.distinct_kv_caches`: a buffer listed twice is swapped back)."""
    return distinct_kv_caches(kv_caches) if window_kv else kv_caches
