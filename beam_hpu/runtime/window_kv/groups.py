"""A window-sized KV cache for Beam's sliding layers: the rules a runner needs over vLLM's hybrid
KV-cache groups, as plain functions.

vLLM's KV-cache manager, given a `SlidingWindowSpec` for each sliding layer, splits Beam's 52
attention layers into groups of equal size (9 full layers; 43 sliding layers in 5 groups of 9,
the last padded), gives each group its own block table per request, and frees a sliding group's
blocks once the window has left them, putting its null block (id 0) in their table columns.
All groups share one pool of block ids: block b of buffer j is the K/V of the j-th layer of
whichever group owns b now. What the runner units take from here:

- the spec each layer gets (`window_kv_spec`) and which windows are allocated (`allocation_windows`);
- one K/V buffer per group position j, shared by the j-th layer of every group
  (`shared_buffer_layers`);
- which group each layer reads (`layer_groups`) and the step's metadata per layer
  (`GroupedMetadata`, its step-wide view being the `primary_group`'s);
- each shared buffer handed once to vllm-gaudi's defragmenter (`distinct_kv_caches`): it swaps
  block contents in every cache it is given, and with prefix caching a swap is an exchange, so a
  buffer listed twice (once per layer sharing it) is swapped back while the block ids stay remapped;
- the most blocks a request holds in a sliding group (`sliding_blocks_bound`), which
  serving/kv_window.py reserves for prefills.

A sliding group's table keeps the logical column order (freed columns hold the null block), so
`beam_hpu.runtime.sliding_window.hpu_window`'s exact-window functions apply to it unchanged. The
exact reads each group must give are checked by the oracles of tests/support/window_kv/oracles.py.
Nothing here imports vLLM except `window_kv_spec`, which builds vLLM's spec object.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from beam_hpu.runtime.sliding_window.hpu_window import _check_geometry

# vLLM's BlockPool holds block 0 back as its null block: what freed sliding columns point at.
NULL_BLOCK_ID = 0


def window_kv_spec(full_spec, sliding_window: int | None):
    """The spec a layer gets under a window-sized cache: vLLM's `SlidingWindowSpec` with the
    `FullAttentionSpec`'s geometry for a sliding layer, the full spec unchanged otherwise."""
    if sliding_window is None:
        return full_spec
    _check_geometry(sliding_window, full_spec.block_size)
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=full_spec.block_size, num_kv_heads=full_spec.num_kv_heads, head_size=full_spec.head_size,
        dtype=full_spec.dtype, head_size_v=full_spec.head_size_v, kv_quant_mode=full_spec.kv_quant_mode,
        sliding_window=sliding_window,
    )


def allocation_windows(layer_windows: Mapping[str, int | None]) -> dict[str, int | None]:
    """The window each layer's KV is allocated for: the model's sliding window (the most common
    one) stays; any other window (an EAGLE3 drafter's 4,096-token layer beside Beam's 512) is
    allocated as full attention (its attention still applies its own window).

    vLLM groups layers by spec into groups the size of the smallest kind: one odd window among
    Beam's layers makes that kind one layer, so every group is one layer (53 groups, 53 block
    tables and metadata sets per step) instead of 1 full + 5 sliding."""
    counts: dict[int, int] = {}
    for w in layer_windows.values():
        if w is not None:
            counts[w] = counts.get(w, 0) + 1
    if not counts:
        return dict(layer_windows)
    main = max(counts, key=lambda w: (counts[w], -w))
    return {name: (w if w == main else None) for name, w in layer_windows.items()}


def layer_groups(group_layer_names: Sequence[Sequence[str]]) -> dict[str, int]:
    """Layer name -> index of its KV-cache group (whose block table and metadata it uses)."""
    groups: dict[str, int] = {}
    for gid, names in enumerate(group_layer_names):
        for name in names:
            if name in groups:
                raise ValueError(f"layer {name} is in KV-cache groups {groups[name]} and {gid}")
            groups[name] = gid
    return groups


def per_layer_metadata(group_metadata: Sequence, group_layer_names: Sequence[Sequence[str]]) -> dict:
    """Layer name -> its group's attention metadata: the dict vLLM's forward context accepts
    (`get_attention_context` picks `attn_metadata[layer_name]`), so each layer reads the block
    lists and slot mapping built from its own group's table."""
    if len(group_metadata) != len(group_layer_names):
        raise ValueError(f"{len(group_metadata)} metadata for {len(group_layer_names)} KV-cache groups")
    return {name: group_metadata[gid] for name, gid in layer_groups(group_layer_names).items()}


def shared_buffer_layers(group_layer_names: Sequence[Sequence[str]]) -> list[list[str]]:
    """Buffer j -> the layers that share it: the j-th layer of every group that has one.

    vLLM lays groups over each other from byte 0 (a block id belongs to one group at a time), so
    the number of buffers is the largest group's size, not the number of layers: Beam's 52 layers
    need 9 K/V buffers, not 52."""
    width = max((len(names) for names in group_layer_names), default=0)
    return [[names[j] for names in group_layer_names if j < len(names)] for j in range(width)]


def tensor_root(t):
    """The tensor `t` is a view of (itself when it is no view): what identifies a buffer on HPU.
    Not its storage pointer: Habana's lazy tensors report a null one, and a lazy view gets a
    storage of its own (beam_hpu/runtime/window_kv/README.md)."""
    return t if t._base is None else t._base


def distinct_kv_caches(kv_caches: Sequence[tuple]) -> list[tuple]:
    """The runner's per-layer (key, value, ...) caches with each shared buffer kept once (first
    occurrence, by the key tensor's root object), for code that acts on every buffer once per step
    (vllm-gaudi's OnlineDefragmenter swaps blocks in each cache it holds)."""
    seen, out = set(), []
    for cache in kv_caches:
        key = id(tensor_root(cache[0]))
        if key not in seen:
            seen.add(key)
            out.append(cache)
    return out


def sliding_blocks_bound(window: int, block_size: int, tokens_in_flight: int) -> int:
    """The most blocks one request holds in a sliding group while `tokens_in_flight` of its
    tokens are scheduled and not yet computed (with async scheduling: including the step whose
    frees lag). The manager keeps the window behind the first of them (W - 1 keys) and the
    in-flight tokens themselves: W - 2 + t consecutive positions after the first, which touch at
    most ceil((W - 2 + t) / bs) + 1 blocks. One decode token gives `window.window_block_count`;
    vLLM's admission cap (`SlidingWindowSpec.max_admission_blocks_per_request`,
    ceil((W - 1 + t) / bs) + 1) is never below it."""
    _check_geometry(window, block_size)
    if tokens_in_flight < 1:
        raise ValueError(f"at least one token is in flight, got {tokens_in_flight}")
    return -(-(window - 2 + tokens_in_flight) // block_size) + 1


class GroupedMetadata(dict):
    """One step's attention metadata under a window-sized cache: layer name -> its KV-cache
    group's metadata (the dict vLLM's forward context and vllm-gaudi's attention pick from by
    `attn_metadata[layer_name]`), plus the step-wide view every other reader of the runner's
    `attn_metadata` expects: attribute access (`.is_prompt`, `.seq_len()`, `.num_blocks()`,
    `.block_list`, ...) reads the primary group's metadata, the full-attention group's, whose
    block counts are the step's largest (what bucketing and graph selection go by).

    `groups[g]` is group g's metadata; `map_groups(fn)` applies fn to each group's once (not once
    per layer: 52 layers share 6 metadata objects) and keeps the layer assignment."""

    def __init__(self, groups: Sequence, group_layer_names: Sequence[Sequence[str]], primary: int = 0):
        if not 0 <= primary < len(groups):
            raise ValueError(f"primary group {primary} of {len(groups)} groups")
        super().__init__(per_layer_metadata(groups, group_layer_names))
        self.groups = list(groups)
        self.group_layer_names = [list(names) for names in group_layer_names]
        self.primary = primary

    def __getattr__(self, name: str):
        # Only names not found on the dict itself land here; the instance's own fields are set
        # in __init__, so a missing one (during unpickling, say) must not recurse.
        if name in ("groups", "group_layer_names", "primary") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.groups[self.primary], name)

    def map_groups(self, fn) -> "GroupedMetadata":
        return GroupedMetadata([fn(md) for md in self.groups], self.group_layer_names, self.primary)

    def __reduce__(self):
        return (GroupedMetadata, (self.groups, self.group_layer_names, self.primary))


def primary_group(group_windows: Sequence[int | None]) -> int:
    """The group whose metadata stands for the step: the first full-attention group (the
    largest block counts), or group 0 if every group slides."""
    return next((g for g, w in enumerate(group_windows) if w is None), 0)
