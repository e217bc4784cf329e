"""How vllm-gaudi's model runner consumes a `GroupedMetadata` (one step's attention metadata per
KV-cache group under a window-sized cache), as plain functions the port unit
`beam-window-kv-metadata` calls from the runner and from `HpuModelAdapter.forward`.

The path of a step's metadata through the tree, and what each stop needs:

1. `_execute_model_generic` reads the step-wide view (`_seq_len`, `_num_blocks`, `_use_graphs`,
   profiler names): GroupedMetadata's attribute access gives the primary (full) group's, whose
   block counts are the step's largest. `_check_config` keys its "not warmed up" warning on
   (phase, batch, seq_len, num_blocks); under groups a graph's inputs also hold every group's
   block lists, so `step_config` adds each group's block-list lengths to that key.
2. `trim_attn_metadata` cuts each group's metadata to the fields the HPU graph may hash, once per
   group (`trim_groups`), into a `TrimmedGroupedMetadata`: a namedtuple of the groups' trimmed
   namedtuples and the (constant) layer names of each group. The PT bridge's `input_hash` hashes
   tuples element by element, tensors by shape (and view), and anything else by value: here only
   the layer-name strings and the group index are hashed by value, and they never change within a
   process, so the graph key depends on the groups' tensor shapes alone (an object made per step
   there, say a layout record, would hash by identity: a new graph every step). Each group's tensors
   appear once among the graph's inputs; the per-layer dict (52 entries over 6 groups) would list
   each tensor 9 times, and the bridge copies every listed input tensor at replay.
3. `HpuModelAdapter.forward` post-processes each group once (`process_groups`: block mapping and
   masks for decode, the causal and sliding-window biases for prompts) and hands the forward
   context a `GroupedMetadata` again: a dict layer name -> its group's processed metadata, which
   vllm-gaudi's attention picks by `attn_metadata[self.layer_name]`. The prompt block lists whose
   dim 0 it marks unbacked are every group's (`prompt_block_lists`).

A plain metadata (any other model, or Beam with BEAM_WINDOW_KV off) is never a GroupedMetadata,
and every caller in the tree takes its stock path for it.
"""

from __future__ import annotations

from collections import namedtuple

from beam_hpu.runtime.window_kv.groups import GroupedMetadata

# groups: each group's trimmed metadata; group_layer_names: each group's layer names (tuples of
# str); primary: the index of the group that stands for the step. Only the groups hold tensors.
TrimmedGroupedMetadata = namedtuple("TrimmedGroupedMetadata", "groups group_layer_names primary")


def is_grouped(metadata) -> bool:
    """A step's per-group metadata, trimmed or not (what HpuModelAdapter.forward processes per
    group: a path that hands it the untrimmed GroupedMetadata is served the same way)."""
    return isinstance(metadata, (TrimmedGroupedMetadata, GroupedMetadata))


def trim_groups(metadata: GroupedMetadata, trim) -> TrimmedGroupedMetadata:
    """`trim` (the tree's trim_attn_metadata) applied to each group's metadata once."""
    return TrimmedGroupedMetadata(tuple(trim(md) for md in metadata.groups),
                                  tuple(tuple(names) for names in metadata.group_layer_names), metadata.primary)


def process_groups(trimmed: TrimmedGroupedMetadata | GroupedMetadata, process) -> GroupedMetadata:
    """`process` (the metadata processor's process_metadata for this step's shapes) applied to each
    group's trimmed metadata once; the result maps every layer to its group's."""
    return GroupedMetadata([process(md) for md in trimmed.groups], trimmed.group_layer_names, trimmed.primary)


def prompt_block_lists(metadata: GroupedMetadata) -> list:
    """Each group's prompt block list (none for decode, none for a group without context)."""
    return [md.block_list for md in metadata.groups
            if getattr(md, "is_prompt", False) and getattr(md, "block_list", None) is not None]


def _numel(tensor) -> int:
    return 0 if tensor is None else int(tensor.numel())


def group_block_counts(metadata) -> tuple[tuple[int, int], ...]:
    """(block list length, window block list length) of each group: the shapes that differ between
    groups' metadata of one step."""
    return tuple((_numel(getattr(md, "block_list", None)), _numel(getattr(md, "window_block_list", None)))
                 for md in metadata.groups)


def step_config(cfg: tuple, attn_metadata) -> tuple:
    """The runner's warm-up key for a step: `cfg` unchanged for plain metadata, with each group's
    block-list lengths appended for a GroupedMetadata (two steps with the same full-group blocks
    but different sliding-group blocks replay different graphs)."""
    if isinstance(attn_metadata, GroupedMetadata):
        return cfg + (group_block_counts(attn_metadata), )
    return cfg
