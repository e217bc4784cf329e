"""The consumer-side rules for per-group attention metadata (beam_hpu/runtime/window_kv/hpu_metadata.py):
trimming and processing once per group, the layer assignment kept through both, the prompt block
lists of every group, the warm-up key, and a graph-input hash (the PT bridge's rule: tuples by
element, tensors by shape, the rest by value) that depends on tensor shapes only."""

from __future__ import annotations

from collections import namedtuple
from types import SimpleNamespace

import torch

from beam_hpu.runtime.window_kv import groups as wkv
from beam_hpu.runtime.window_kv import hpu_metadata as wkm
from tests.support.hpu_graph_hash import bridge_hash, bridge_tensors, replay_mismatches

GROUPS = [["full.0", "full.1"], ["slide.0", "slide.1"], ["slide.2"]]
Trimmed = namedtuple("Trimmed", "block_list window_block_list is_prompt block_size")


def metadata(blocks: list[int], window: list[int], is_prompt=False):
    return SimpleNamespace(block_list=torch.tensor(blocks), window_block_list=torch.tensor(window),
                           is_prompt=is_prompt, block_size=4, seq_len=lambda: 7)


def grouped(is_prompt=False, offset=0):
    groups = [metadata([1 + offset, 2, 3, 4], [3, 4], is_prompt), metadata([0, 5, 6], [5, 6], is_prompt),
              metadata([7], [7], is_prompt)]
    return wkv.GroupedMetadata(groups, GROUPS, primary=0)


def trim(md):
    return Trimmed(md.block_list, md.window_block_list, md.is_prompt, md.block_size)


def test_trim_and_process_run_once_per_group_and_keep_each_layers_group():
    md = grouped()
    trimmed_calls, processed_calls = [], []
    trimmed = wkm.trim_groups(md, lambda g: trimmed_calls.append(g) or trim(g))
    assert trimmed_calls == md.groups  # 3 groups, 5 layers: once each
    assert isinstance(trimmed, wkm.TrimmedGroupedMetadata) and len(trimmed.groups) == 3

    def process(g):
        processed_calls.append(g)
        return g._replace(block_size=g.block_size * 10)

    assert wkm.is_grouped(trimmed) and wkm.is_grouped(md) and not wkm.is_grouped(md.groups[0])
    assert not wkm.is_grouped({name: trim(g) for name, g in md.items()})  # a plain per-layer dict
    out = wkm.process_groups(trimmed, process)
    assert processed_calls == list(trimmed.groups)
    assert isinstance(out, wkv.GroupedMetadata) and out.primary == 0
    for gid, names in enumerate(GROUPS):
        for name in names:
            assert out[name] is out.groups[gid]
            assert torch.equal(out[name].block_list, md.groups[gid].block_list) and out[name].block_size == 40
    assert out.is_prompt is False and torch.equal(out.block_list, torch.tensor([1, 2, 3, 4]))


def test_graph_key_depends_on_shapes_only_and_lists_each_tensor_once():
    a, b = wkm.trim_groups(grouped(offset=0), trim), wkm.trim_groups(grouped(offset=50), trim)
    assert bridge_hash(a) == bridge_hash(b)  # other block ids, same shapes: the same graph
    longer = grouped()
    longer.groups[1].window_block_list = torch.tensor([5, 6, 8])
    assert bridge_hash(wkm.trim_groups(longer, trim)) != bridge_hash(a)
    assert len(bridge_tensors(a)) == 3 * 2  # two tensors a group, once each
    per_layer = {name: trim(g) for name, g in grouped().items()}  # the per-layer dict, for contrast
    assert len(bridge_tensors(per_layer)) == 5 * 2


def test_prompt_block_lists_are_every_groups():
    md = grouped(is_prompt=True)
    md.groups[2].block_list = None  # a group with no context blocks
    assert [t.tolist() for t in wkm.prompt_block_lists(md)] == [[1, 2, 3, 4], [0, 5, 6]]
    assert wkm.prompt_block_lists(grouped(is_prompt=False)) == []


def test_step_config_adds_each_groups_block_counts_for_grouped_metadata_only():
    cfg = ("decode", 4, 1, 4)
    assert wkm.step_config(cfg, grouped()) == cfg + (((4, 2), (3, 2), (1, 1)), )
    plain = metadata([1, 2, 3, 4], [3, 4])
    assert wkm.step_config(cfg, plain) is cfg


def test_the_graph_key_tells_a_view_from_a_tensor_and_a_replay_binds_by_position():
    """The bridge's key hashes a view's layout (our model of get_view_hash) but no dtype: a view and
    its copy are two graphs; a same-shaped input of another dtype replays the captured graph, bound
    by position, which replay_mismatches names."""
    padded = torch.arange(12, dtype=torch.int32)
    view, copy = padded[:8], padded[:8].clone()
    assert bridge_hash((view,)) != bridge_hash((copy,)) and bridge_hash((copy,)) == bridge_hash((copy + 1,))
    captured = [copy, torch.zeros(3)]
    assert replay_mismatches(captured, [copy + 1, torch.ones(3)]) == []
    as_int = [copy, torch.zeros(3, dtype=torch.int64)]
    assert bridge_hash(as_int) == bridge_hash(captured)
    assert replay_mismatches(captured, as_int) == ["input 1: (3,) torch.int64 strides (1,), captured (3,) torch.float32 strides (1,)"]
    assert replay_mismatches(captured, captured[:1]) == ["1 input tensors, the graph was captured with 2"]
