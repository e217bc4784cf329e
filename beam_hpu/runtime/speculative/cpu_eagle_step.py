"""One EAGLE drafting step's slot mapping and sequence lengths in plain torch, for vLLM-CPU.

Why: vLLM 0.30.0's EAGLE proposer (`v1/spec_decode/llm_base_proposer.py`) advances every request
by one position between drafting steps through `eagle_step_update_slot_mapping_and_metadata`,
which launches `_eagle_step_slot_mapping_metadata`, a JIT-warmup Triton dispatcher holding its
kernel itself. vLLM-CPU's runner swaps the `.kernel` of the other three EAGLE dispatchers for its
C++ ops but only the module-level name of this one, so the second drafting step of any EAGLE or
EAGLE3 drafter raises "Cannot inspect kernel parameters" and the engine dies. The runtime patch
`cpu-eagle-step` (beam_hpu/runtime/speculative/patch_cpu_eagle_step.py) routes the proposer's call here on CPU.

Per request r (the definition the kernel documents): the new position is position + 1, or 0 when
that reaches max_model_len; its KV slot is block_table[r, position // block_size] * block_size +
position % block_size (the block index clamped to the table), or the padding slot when the
position overflowed; seq_lens[r] becomes seq_lens[r] + 1 (1 on overflow), at most max_model_len.
Slots of padded requests (r >= batch size, up to input_batch_size) get the padding slot.
"""

from __future__ import annotations

import torch


def advance_one_position(positions_1d: torch.Tensor, block_table_tensor: torch.Tensor, seq_lens: torch.Tensor,
                         block_size: int, max_model_len: int, out_clamped_positions: torch.Tensor,
                         out_slot_mapping: torch.Tensor, input_batch_size: int | None = None,
                         *, padding_slot: int) -> None:
    """In place: out_clamped_positions[:B], out_slot_mapping[:input_batch_size], seq_lens[:B]."""
    batch = positions_1d.shape[0]
    input_batch_size = batch if input_batch_size is None else input_batch_size
    new_position = positions_1d.long() + 1
    overflow = new_position >= max_model_len
    position = torch.where(overflow, torch.zeros_like(new_position), new_position)
    block_index = (position // block_size).clamp(max=block_table_tensor.shape[1] - 1)
    block = block_table_tensor[torch.arange(batch), block_index].long()
    slot = torch.where(overflow, torch.full_like(position, padding_slot), block * block_size + position % block_size)
    new_len = torch.where(overflow, torch.ones_like(new_position), seq_lens.long() + 1).clamp(max=max_model_len)
    out_clamped_positions[:batch] = position.to(out_clamped_positions.dtype)
    out_slot_mapping[:batch] = slot.to(out_slot_mapping.dtype)
    out_slot_mapping[batch:input_batch_size] = padding_slot
    seq_lens[:batch] = new_len.to(seq_lens.dtype)
