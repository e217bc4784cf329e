"""window_kv_steps: which runners build a step per KV-cache group, and how the builds combine."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from beam_hpu.runtime.window_kv import hpu_steps as steps
from beam_hpu.runtime.window_kv.groups import GroupedMetadata
from tests.support.window_kv.configs import beam_kv_cache_config, full_only_config

pytest.importorskip("vllm")


def test_no_sliding_group_builds_once():
    assert steps.step_groups(None, "beam") is None
    assert steps.step_groups(SimpleNamespace(kv_cache_groups=[]), "beam") is None
    assert steps.step_groups(full_only_config(4, 10, head_size=8), "beam") is None  # the switch off: one full group
    assert steps.step_groups(full_only_config(4, 10, head_size=8), "llama") is None


def test_beams_window_groups_and_their_primary():
    _, kc = beam_kv_cache_config(4, 8, 60)
    groups = steps.step_groups(kc, "beam")
    assert len(groups.group_layer_names) == 6 and groups.windows.count(8) == 5
    assert groups.windows[groups.primary] is None
    assert "model.layers.5.self_attn.attn" in groups.group_layer_names[groups.primary]
    with pytest.raises(ValueError, match="model type 'llama'"):
        steps.step_groups(kc, "llama")


def test_draft_group_is_the_full_group_holding_the_drafter():
    assert steps.draft_group(None, ["draft.attn"]) == 0  # stock: block_table[0]
    groups = steps.StepGroups((("a", "b"), ("c", "draft")), (8, None))
    assert steps.draft_group(groups, ["draft"]) == 1
    assert steps.draft_group(groups, []) == 1
    with pytest.raises(ValueError, match="groups \\[0\\]"):
        steps.draft_group(groups, ["a"])  # a drafter in a sliding group: its table would miss keys
    with pytest.raises(ValueError, match="groups \\[0, 1\\]"):
        steps.draft_group(groups, ["a", "draft"])
    with pytest.raises(ValueError, match="in no KV-cache group"):
        steps.draft_group(groups, ["elsewhere"])


def test_build_per_group_selects_each_group_and_keeps_appends_once():
    groups = steps.StepGroups((("a", ), ("b", ), ("c", )), (8, 8, None))
    selected, invalid = [], [7]

    def build():
        invalid.append(3)
        return selected[-1]

    outs = steps.build_per_group(groups, build, selected.append, [invalid])
    assert outs == [0, 1, 2] and selected == [0, None, 1, None, 2, None] and invalid == [7, 3]
    seen = iter(range(10))
    with pytest.raises(ValueError, match="group 1's build appended"):
        steps.build_per_group(groups, lambda: invalid.append(next(seen)), lambda g: None, [invalid])


def test_same_value_names_the_differing_field():
    steps.same_value([[torch.arange(3), np.ones(2), {"x": 1}]] * 2, "s")
    with pytest.raises(ValueError, match=r"s\[0\]: group 1's values differ"):
        steps.same_value([[torch.arange(3)], [torch.arange(1, 4)]], "s")
    with pytest.raises(ValueError, match=r"s\.b: group 1 has 2"):
        steps.same_value([SimpleNamespace(a=1, b=1), SimpleNamespace(a=1, b=2)], "s")
    with pytest.raises(ValueError, match="group 1 is torch.int32"):
        steps.same_value([torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32)], "s")


@dataclass
class Inputs:
    num: int
    token_ids: torch.Tensor | None = None
    attn_metadata: object = None
    prompts: list = field(default_factory=list)


def test_combine_replaces_each_metadata_with_a_grouped_one():
    groups = steps.StepGroups((("a", "b"), ("c", )), (8, None))
    mds = [SimpleNamespace(block_list=torch.tensor([g, 9]), is_prompt=False) for g in range(2)]
    outs = [((Inputs(1, torch.arange(4), [mds[g]]), None), (Inputs(2, torch.arange(2), mds[g]), None))
            for g in range(2)]
    (prefill, dummy), (decode, none) = steps.combine_step_inputs(outs, groups)
    assert dummy is None and none is None and prefill.num == 1 and decode.num == 2
    grouped = prefill.attn_metadata[0]
    assert isinstance(grouped, GroupedMetadata) and grouped["a"] is mds[0] and grouped["c"] is mds[1]
    assert grouped.block_list is mds[1].block_list  # the full group stands for the step
    assert decode.attn_metadata.groups == mds
    outs[1][1][0].token_ids = torch.arange(1, 3)
    with pytest.raises(ValueError, match=r"step\[1\]\[0\]\.token_ids"):
        steps.combine_step_inputs(outs, groups)


def test_combine_refuses_metadata_one_build_overwrote():
    groups = steps.StepGroups((("a", ), ("b", )), (8, None))
    persistent = torch.zeros(4)
    outs = [Inputs(1, attn_metadata=SimpleNamespace(slot_mapping=persistent[:2])) for _ in range(2)]
    with pytest.raises(ValueError, match="group 1's slot_mapping shares a buffer with group 0's slot_mapping"):
        steps.combine_step_inputs(outs, groups)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_disjoint_metadata_never_asks_the_storage_pointer(device):
    """Lazy HPU tensors report a null storage pointer (as meta tensors do here): separate buffers
    stay separate, and two views of one buffer are still caught."""
    separate = [SimpleNamespace(slot_mapping=torch.zeros(4, device=device), block_list=torch.zeros(3, device=device))
                for _ in range(6)]
    steps.disjoint_metadata(separate)
    persistent = torch.zeros(8, device=device)
    shared = [SimpleNamespace(slot_mapping=persistent[:4]), SimpleNamespace(slot_mapping=persistent[4:])]
    with pytest.raises(ValueError, match="group 1's slot_mapping shares a buffer with group 0's slot_mapping"):
        steps.disjoint_metadata(shared)
