"""xgrammar's packed token bitmask applied to the logits on the logits' own device.

vllm-gaudi's structured-output step copies the logits to the host, runs xgrammar's CPU kernel and
copies them back: a device-to-host sync on every structured step, and with the Beam response
grammar always on, that is nearly every step. This function does the same masking with plain
torch ops where the logits live: the (small) bitmask goes to the device, the logits never leave
it, and nothing in it reads a device value on the host. It is a drop-in for
`xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=..., indices=...)`, with the same
meaning of every argument, so the runner patch swaps one call for the other.

The bitmask is int32 [rows, ceil(V / 32)]; bit b of word w allows token 32 * w + b. A row of -1
(every bit set) allows every token: vLLM fills the rows of requests without a grammar that way.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# The int32 with only bit b set, for b = 0..31; bit 31 is the sign bit.
_BIT_VALUES = [1 << b for b in range(31)] + [-(1 << 31)]


def apply_token_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor | np.ndarray,
    *,
    vocab_size: int | None = None,
    indices: torch.Tensor | list[int] | None = None,
) -> None:
    """Set logits[r, t] to -inf, in place, wherever the bitmask forbids token t for row r.

    `vocab_size`: tokens 0..vocab_size-1 are masked; later logits columns are left alone (vLLM
    trims padded vocabulary before sampling). Default min(logits width, bitmask width * 32), as in
    xgrammar: a bitmask narrower than the logits leaves the extra columns alone, a wider one has
    its extra bits ignored.
    `indices`: only these logits rows are masked, each with the bitmask row of the same number;
    the bitmask may then have a different number of rows than the logits.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    packed = torch.from_numpy(bitmask) if isinstance(bitmask, np.ndarray) else bitmask
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"bitmask must be int32 [rows, words], got {packed.dtype} {tuple(packed.shape)}")
    rows, width = logits.shape
    covered = packed.shape[1] * 32
    vocab = min(width, covered) if vocab_size is None else vocab_size
    if not 0 <= vocab <= min(width, covered):
        raise ValueError(
            f"vocab_size {vocab} exceeds the logits ({width} columns) or the bitmask ({covered} tokens)"
        )
    if indices is None and packed.shape[0] != rows:
        raise ValueError(f"bitmask has {packed.shape[0]} rows for {rows} rows of logits; pass indices")

    device = logits.device
    words = math.ceil(vocab / 32)
    packed = packed[:rows, :words].to(device, non_blocking=True)  # [<=R, words]
    if packed.shape[0] < rows:  # rows past the bitmask are never in `indices`: allow all
        packed = torch.cat([packed, packed.new_full((rows - packed.shape[0], words), -1)])  # [R, words]
    bit_values = torch.tensor(_BIT_VALUES, dtype=torch.int32, device=device)  # [32]
    allowed = (packed.unsqueeze(-1) & bit_values) != 0  # [R, words, 32]
    allowed = allowed.flatten(1)[:, :vocab]  # [R, vocab]
    if indices is not None:
        index = torch.as_tensor(indices, dtype=torch.int64).to(device, non_blocking=True)  # [N]
        selected = torch.zeros(rows, dtype=torch.bool, device=device).index_fill_(0, index, True)  # [R]
        allowed |= ~selected.unsqueeze(1)
    logits[:, :vocab].masked_fill_(~allowed, float("-inf"))


def device_mask_enabled(env=None) -> bool:
    """BEAM_GRAMMAR_DEVICE_MASK (beam_hpu.settings.switches): whether the runner patch masks on the device."""
    from beam_hpu.settings import switches

    return bool(switches.current("BEAM_GRAMMAR_DEVICE_MASK", env))
