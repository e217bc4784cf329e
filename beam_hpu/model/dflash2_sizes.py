"""The sizes of Beam's published DFlash2 drafter (reflection/Beam-1.0-501B-A23B-DFlash2), in one
place for what models or measures it at full size (`beam-hpu card-check`, `serving/kv_capacity.py`).

From its card: 5 layers, hidden 5120, 40 query / 8 KV heads of 128, SwiGLU 17,408, Beam's hidden
states at layers 4, 16, 28, 40, 46, a 4,096-token window, block 8 for serving, Beam's vocabulary
(its embedding and LM head are Beam's). Not on the card: two-tap convolutions over groups of 16
channels and a selector of rank 256 are what its 1.93B count implies
(tests/model/test_dflash2.py), and the selector's top-k 8 is the tiny drafter's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DFlash2Sizes:
    layers: int = 5
    hidden: int = 5120
    q_heads: int = 40
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 17408
    window: int = 4096
    target_layer_ids: tuple[int, ...] = (4, 16, 28, 40, 46)
    taps: int = 2
    conv_group: int = 16
    rank: int = 256
    top_k: int = 8
    vocab: int = 151936
    block: int = 8
