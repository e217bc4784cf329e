"""Port unit beam-window-kv-steps on the vllm-gaudi tree named by GAUDI_FIXES_ROOT (skipped without
it): the tree's own HPUModelRunner._prepare_inputs (tests/support/gaudi/window_kv_steps.py), patched with the port,
builds whole steps over the per-group block tables of vLLM's own KVCacheManager (prefix caching on)
for Beam's 52 layers under a window-sized cache: prompts with prefix-cache hits, chunked prefill
over cached context, merged prefill, decodes and speculative verify rows with uneven drafts in one
batch, padding rows and DP padding's dummy batches.

Each layer writes its keys with the tree's VLLMKVCache.forward at the slot mapping of its group's
metadata into the buffer it shares (window_kv.shared_buffer_layers); every key each query then
attends (decode: the tree's _set_block_mapping over the group's block lists; prefill: the context
blocks with the tree's _set_attn_bias_for_sliding_window in sliding layers, the whole context in
full layers) is read back and must be exactly the definition's (window W: query i sees
i - W < j <= i; full layers everything), written by that layer for that sequence. Each group's
metadata must equal what the tree without this unit builds from that group's table alone (no
build overwrote another's), and with one full-attention group (the switch off) the patched
tree's step must equal the tree's without the unit.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from beam_hpu.runtime.window_kv import groups as wkv
from tests.support.gaudi.source import load
from tests.support.gaudi.tree import port_tree
from tests.support.gaudi.window_kv_runner import make_runner, set_batch
from tests.support.gaudi.window_kv_steps import BS, WIDTH, WINDOW, run
from tests.support.window_kv.configs import beam_kv_cache_config, beam_layer_windows, full_only_config, vllm_config

pytestmark = pytest.mark.gaudi_tree
UNIT = "beam-window-kv-steps"


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """(the port's tree, the port's tree without this unit)."""
    return [port_tree(tmp_path_factory.mktemp(name) / "site", without=drop)
            for name, drop in (("port", ()), ("without", (UNIT, )))]


def test_every_step_kind_reads_exact_windows_over_per_group_tables(trees):
    s = run(trees, seed=0, n_steps=40)
    assert len(s.groups) == 6 and s.windows.count(WINDOW) == 5
    assert s.mismatches == 0, s.first_mismatch
    for kind in ("decode", "verify", "prefill with context", "prefix hit"):
        assert s.kinds.get(kind, 0) > 0, s.kinds
    assert s.null_columns > 0 and s.reused > 0 and s.rows_checked > 2000, (s.null_columns, s.reused)


def test_merged_prefill_writes_each_groups_blocks(trees):
    s = run(trees, seed=1, n_steps=25, merged=True)
    assert s.mismatches == 0, s.first_mismatch
    assert s.kinds.get("merged prefill", 0) > 0, s.kinds


def test_switch_off_builds_the_stock_step(trees):
    """One full-attention group (BEAM_WINDOW_KV=0, or any other model): the step is the tree's
    without the unit, tensor for tensor (compare_with_reference), and its metadata a plain one."""
    s = run(trees, seed=2, n_steps=20, window_kv=False)
    assert len(s.groups) == 1 and s.mismatches == 0, s.first_mismatch
    assert s.kinds.get("decode", 0) > 0 and s.kinds.get("prefill with context", 0) > 0


def test_without_the_unit_layers_read_another_groups_blocks(trees):
    """The tree without beam-window-kv-steps builds one metadata from group 0's table (a sliding
    group) for all 52 layers: the full layers and the other sliding groups read the wrong keys."""
    s = run(trees, seed=0, n_steps=12, with_unit=False)
    assert s.mismatches > 0


def test_dp_padding_dummies_carry_one_metadata_per_group(trees):
    s = run(trees, seed=3, n_steps=12, dp_padding=1)
    assert s.mismatches == 0, s.first_mismatch
    assert s.kinds.get("dummy prefill", 0) + s.kinds.get("dummy decode", 0) > 0, s.kinds


def beam_with_drafter_config():
    """Beam's layers and an EAGLE3 drafter's one layer (its 4,096-token window allocated full)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    full = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=128, dtype=torch.bfloat16)
    windows = wkv.allocation_windows({**beam_layer_windows(WINDOW), "drafter.layers.0.self_attn.attn": 4096})
    specs = {name: wkv.window_kv_spec(full, w) for name, w in windows.items()}
    config = vllm_config()
    groups = get_kv_cache_groups(config, specs)
    return get_kv_cache_config_from_groups(config, groups, 100 * 10 * full.page_size_bytes)


@pytest.mark.parametrize("window_kv", [True, False])
def test_eagle_draft_steps_read_the_drafters_group(trees, window_kv):
    kc = beam_with_drafter_config() if window_kv else full_only_config(BS, 100)
    runner = make_runner(trees[0].runner, kc, block_size=BS, window=WINDOW, num_kv_blocks=100)
    tables = [[[10 * g + b + 1] * 3 for b in range(2)] for g in range(len(kc.kv_cache_groups))]
    set_batch(runner, [SimpleNamespace(rid=f"r{b}", tokens=[1] * 9, computed=8, prompt_len=4) for b in range(2)],
              tables, WIDTH)
    seen = []
    runner.drafter = SimpleNamespace(
        _draft_attn_layer_names={"drafter.layers.0.self_attn.attn"},
        prepare_inputs=lambda md, spec, sampled: (md, torch.arange(2), torch.arange(2)),
        propose=lambda *args: seen.append(args[5]) or torch.zeros(2, 1, dtype=torch.int64))
    runner.use_aux_hidden_state_outputs = False
    decode = SimpleNamespace(spec_decode_metadata=object(), position_ids=torch.arange(2), attn_metadata=None)
    runner.propose_eagle_decode([[1], [2]], torch.tensor([[1], [2]]), torch.zeros(2, 4), None, 2, decode)
    runner.propose_eagle_prefill([torch.tensor([3])], [torch.zeros(1, 4, 4)], None, 0,
                                 torch.zeros(1, 4, dtype=torch.int64), torch.arange(4), None, torch.tensor([3]), 1)
    names = [g.layer_names for g in kc.kv_cache_groups]
    want = next(g for g, n in enumerate(names) if "drafter.layers.0.self_attn.attn" in n) if window_kv else 0
    assert kc.kv_cache_groups[want].kv_cache_spec.__class__.__name__ == "FullAttentionSpec"
    assert seen[0][:, :3].tolist() == tables[want][:2] and seen[1][:, :3].tolist() == tables[want][1:2]
    if window_kv:
        assert want != 0  # stock's block_table[0] would be a sliding group's


@pytest.mark.parametrize("window_kv", [True, False])
def test_warm_up_requests_bring_one_block_list_per_group(trees, window_kv):
    kc = beam_kv_cache_config(BS, WINDOW, 100)[1] if window_kv else full_only_config(BS, 100)
    runner = make_runner(trees[0].runner, kc, block_size=BS, window=WINDOW, num_kv_blocks=100)
    requests, scheduled = [], {}
    runner._add_dummy_request(requests, scheduled, 0, 21, 21, True, block_id=7)
    assert requests[0].block_ids == ([[7] * 6] * 6 if window_kv else [[7] * 6]) and scheduled == {"0": 21}


def test_multi_token_decodes_move_last_with_every_groups_table(trees):
    """The tree's ensure_multi_token_decodes_last reorders the batch by the tree's
    InputBatch.swap_states, whose vLLM MultiGroupBlockTable.swap_row moves every group's row: a
    verify row keeps its own tables in all six groups."""
    from vllm.utils.collection_utils import swap_dict_values
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    n_groups, n = 6, 4
    runner_file = trees[0].runner
    input_batch = runner_file.parent / "hpu_input_batch.py"
    swap = load(input_batch, "swap_states", "InputBatch", swap_dict_values=swap_dict_values)
    reorder = load(runner_file, "ensure_multi_token_decodes_last")
    tables = MultiGroupBlockTable(max_num_reqs=n, max_num_batched_tokens=64, pin_memory=False, device="cpu",
                                  block_sizes=[BS] * n_groups, kernel_block_sizes=[BS] * n_groups,
                                  max_num_blocks=[8] * n_groups)
    rows = {f"r{b}": tuple([10 * g + b + 1, 100 + 10 * g + b] for g in range(n_groups)) for b in range(n)}
    for b, rid in enumerate(rows):
        tables.add_row(rows[rid], b)
    arrays = {k: np.arange(n) for k in (
        "num_tokens", "num_tokens_no_spec", "temperature_cpu", "top_p_cpu", "top_k_cpu", "frequency_penalties_cpu",
        "presence_penalties_cpu", "repetition_penalties_cpu", "min_p_cpu")}
    batch = SimpleNamespace(
        _req_ids=list(rows), req_output_token_ids=[[] for _ in range(n)],
        req_id_to_index={r: b for b, r in enumerate(rows)}, num_prompt_tokens=np.full(n, 2),
        num_computed_tokens_cpu=np.full(n, 5), token_ids_cpu=np.zeros((n, 8)), generators={}, bad_words_token_ids={},
        request_lora_mapping=np.zeros(n), is_pooling_model=False, allowed_token_ids_mask_cpu_tensor=None,
        block_table=tables, num_reqs=n, **arrays)
    batch.req_ids = batch._req_ids
    batch.swap_states = lambda i, j: swap(batch, i, j)
    reorder(batch, {"r0": 4, "r1": 1, "r2": 2, "r3": 1})
    assert batch.req_ids[:2] == ["r1", "r3"] and sorted(batch.req_ids[2:]) == ["r0", "r2"]
    for b, rid in enumerate(batch.req_ids):
        for g in range(n_groups):
            assert tables[g].get_cpu_tensor()[b, :2].tolist() == rows[rid][g], (rid, g)


def test_async_scheduling_lists_each_discarded_prefill_logit_once(trees):
    s = run(trees, seed=4, n_steps=15, async_scheduling=True)
    assert s.mismatches == 0, s.first_mismatch
    assert s.invalid_listed > 0  # partial prefills met, each listed once (not once per group)
