"""beam_hpu.runtime.window_kv.hpu_cache: the switch, the specs, and the shared-buffer allocation plan,
against vLLM 0.30's own spec classes, grouping and KVCacheConfig layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from beam_hpu.runtime.window_kv import groups as wkv
from beam_hpu.runtime.window_kv import hpu_cache as wkc
from beam_hpu.settings.switches import SwitchError
from tests.support.window_kv.configs import beam_kv_cache_config, beam_layer_windows, full_only_config, vllm_config

pytest.importorskip("vllm")
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

BS = 128
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=128, dtype=torch.bfloat16)


# ---------------------------------------------------------------- the switch

@pytest.mark.parametrize("env, model_type, on", [
    ({"BEAM_WINDOW_KV": "1"}, "beam", True),
    ({"BEAM_WINDOW_KV": "true"}, "beam", True),
    ({"BEAM_WINDOW_KV": "0"}, "beam", False),
    ({}, "beam", False),  # off by default
    ({"BEAM_WINDOW_KV": "1"}, "llama", False),
    ({"BEAM_WINDOW_KV": "1"}, None, False),  # no model config: the stock specs
])
def test_switch_acts_for_beam_only(env, model_type, on):
    assert wkc.hpu_window_kv_enabled(model_type, env) is on


def test_switch_is_validated_for_every_model():
    with pytest.raises(SwitchError, match="BEAM_WINDOW_KV"):
        wkc.hpu_window_kv_enabled("llama", {"BEAM_WINDOW_KV": "yes"})


# ---------------------------------------------------------------- specs

def test_sliding_layers_get_window_specs_and_others_keep_theirs():
    windows = beam_layer_windows(512)
    specs = {name: FULL for name in windows}
    out = wkc.window_kv_cache_specs(specs, windows)
    assert list(out) == list(specs)
    for name, w in windows.items():
        if w is None:
            assert out[name] is FULL
        else:
            assert type(out[name]) is SlidingWindowSpec and out[name].sliding_window == 512
            assert out[name].page_size_bytes == FULL.page_size_bytes


def test_a_drafters_odd_window_stays_full_and_non_plain_specs_are_untouched():
    windows = {**beam_layer_windows(512), "drafter.attn": 4096, "mla.attn": 512}
    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    specs = {**{name: FULL for name in beam_layer_windows(512)}, "drafter.attn": FULL, "mla.attn": mla}
    out = wkc.window_kv_cache_specs(specs, windows)
    assert out["drafter.attn"] is FULL and out["mla.attn"] is mla
    assert sum(type(s) is SlidingWindowSpec for s in out.values()) == 43


def test_profiled_as_attention_is_the_stock_rule_plus_sliding():
    assert wkc.profiled_as_attention(FULL)
    assert wkc.profiled_as_attention(wkv.window_kv_spec(FULL, 512))
    assert wkc.profiled_as_attention(MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576,
                                                      dtype=torch.bfloat16))  # a FullAttentionSpec, as stock


# ---------------------------------------------------------------- groups and buffers

def test_block_sizes_one_per_group_only_when_window_sized():
    _, kc = beam_kv_cache_config(BS, 512, num_blocks=50)
    assert wkc.window_kv_block_sizes(kc) == [BS] * 6
    assert wkc.window_kv_block_sizes(full_only_config(BS, 50)) is None  # stock: one table, untouched


def test_a_group_of_another_kind_is_refused():
    _, kc = beam_kv_cache_config(BS, 512, num_blocks=50)
    odd = dataclasses.replace(kc.kv_cache_groups[0], kv_cache_spec=MLAAttentionSpec(
        block_size=BS, num_kv_heads=1, head_size=128, dtype=torch.bfloat16))
    kc.kv_cache_groups[0] = odd
    with pytest.raises(ValueError, match="MLAAttentionSpec"):
        wkc.window_kv_block_sizes(kc)


def test_buffers_are_vllms_aliased_layers_nine_with_the_pad_block():
    _, kc = beam_kv_cache_config(BS, 512, num_blocks=50)
    plan = wkc.window_kv_buffers(kc)
    groups = [g.layer_names for g in kc.kv_cache_groups]
    assert plan.layers == wkv.shared_buffer_layers(groups)
    assert sorted(map(sorted, wkc.aliased_layers(kc.kv_cache_tensors))) == sorted(map(sorted, plan.layers))
    assert len(plan.layers) == 9 and sum(map(len, plan.layers)) == 52
    assert plan.num_blocks == 50 and plan.pad_block_id == 50
    # 9 buffers of 51 blocks: vLLM's pool (what its tensors describe) plus one pad block each.
    assert plan.device_bytes() == 9 * 51 * FULL.page_size_bytes
    assert plan.device_bytes() - kc.kv_cache_tensors[0].size == 9 * FULL.page_size_bytes


def test_block_outermost_layout_aliases_the_same_layers():
    config = vllm_config()
    config.cache_config.kv_cache_layout = "BLHNC"  # vLLM's block-outermost layout
    specs = {name: wkv.window_kv_spec(FULL, w) for name, w in beam_layer_windows(512).items()}
    groups = get_kv_cache_groups(config, dict(specs))
    kc = get_kv_cache_config_from_groups(config, groups, 40 * 9 * FULL.page_size_bytes)
    assert kc.kv_cache_tensors[0].layer_stride == FULL.page_size_bytes  # pages interleaved per block
    assert wkc.window_kv_buffers(kc).layers == wkv.shared_buffer_layers([g.layer_names for g in groups])


def test_a_layout_that_does_not_alias_by_position_is_refused():
    _, kc = beam_kv_cache_config(BS, 512, num_blocks=50)
    t = kc.kv_cache_tensors[1]
    kc.kv_cache_tensors[1] = dataclasses.replace(t, layers=list(reversed(t.layers)))
    with pytest.raises(ValueError, match="aliases"):
        wkc.window_kv_buffers(kc)


def test_short_tensors_and_mixed_geometry_are_refused():
    _, kc = beam_kv_cache_config(BS, 512, num_blocks=50)
    short = dataclasses.replace(kc, kv_cache_tensors=[dataclasses.replace(t, size=t.size - 1)
                                                      for t in kc.kv_cache_tensors])
    with pytest.raises(ValueError, match="fewer than 50 blocks"):
        wkc.window_kv_buffers(short)
    g = kc.kv_cache_groups[1]
    kc.kv_cache_groups[1] = dataclasses.replace(g, kv_cache_spec=dataclasses.replace(g.kv_cache_spec, num_kv_heads=2))
    with pytest.raises(ValueError, match="geometry"):
        wkc.window_kv_buffers(kc)


def test_dynamic_fp8_kv_scales_are_refused_and_only_for_fp8():
    env = {"QUANT_CONFIG": "q.json", "VLLM_DYNAMIC_KV_QUANT": "1"}
    _, kc = beam_kv_cache_config(BS, 512, num_blocks=50)
    wkc.window_kv_buffers(kc, env)  # bf16: vllm-gaudi creates no scales either
    _, kc8 = beam_kv_cache_config(BS, 512, num_blocks=50, dtype=torch.float8_e4m3fn)
    wkc.window_kv_buffers(kc8, {"QUANT_CONFIG": "q.json"})
    with pytest.raises(NotImplementedError, match="BEAM_WINDOW_KV=0"):
        wkc.window_kv_buffers(kc8, env)


def test_shared_kv_caches_make_one_cache_per_buffer():
    made = []

    def make():
        made.append((torch.zeros(4), torch.zeros(4), None, None))
        return made[-1]

    buffers = [["a0", "b0"], ["a1", "b1"], ["a2"]]
    caches = wkc.shared_kv_caches(buffers, make)
    assert len(made) == 3
    assert caches["a0"] is caches["b0"] is made[0] and caches["a2"] is made[2]
    caches["b1"][0][1] = 5.0
    assert [n for n in caches if caches[n][0][1] == 5.0] == ["a1", "b1"]


def test_defragmenter_caches_off_is_the_runners_list_itself():
    shared = (torch.zeros(4), torch.zeros(4))
    other = (torch.zeros(4), torch.zeros(4))
    per_layer = [shared, other, shared]
    assert wkc.defragmenter_caches(per_layer, False) is per_layer
    assert wkc.defragmenter_caches(per_layer, True) == [shared, other]
