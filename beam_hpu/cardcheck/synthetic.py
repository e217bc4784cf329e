"""A Beam of the published shapes with fewer layers: what card-check serves on a node that does not
hold the 501B checkpoint.

Every shape is Beam-1.0-501B-A23B's (../shared/REFERENCE.md: hidden 5120, 48 query / 8 KV heads of
128, MoE intermediate 2560, 256 experts in 8 groups keeping 4, top-8, vocabulary 151,936, window
512) and the FP8 checkpoint's quantisation block, but with SYNTHETIC_LAYERS layers: three sliding
and one full, every one a MoE layer (49 of the published 52 are). Only config.json is written:
vLLM's dummy loader (`--load-format dummy`) draws random weights of those shapes at load, so
nothing of the 501B model's size is written or read. Values no timing depends on (RoPE theta, the
stop and pad ids) are the tiny writer's.

Its figures are per step of a 4-layer model; `extrapolate_step_ms` states what they give for 52
layers as a labelled model.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from beam_hpu.tiny.checkpoint import EOS_TOKENS, PAD_TOKEN, TinyPreset, config_dict

PUBLISHED_LAYERS = 52
PUBLISHED_VOCAB = 151_936
SYNTHETIC_LAYERS = 4  # 3 sliding + 1 full
PUBLISHED = TinyPreset(hidden_size=5120, num_hidden_layers=PUBLISHED_LAYERS, full_every=6, num_dense_layers=3,
                       num_attention_heads=48, num_key_value_heads=8, head_dim=128, intermediate_size=20480,
                       moe_intermediate_size=2560, num_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                       sliding_window=512, final_logit_softcapping=30.0, routed_scaling_factor=2.5,
                       max_position_embeddings=262_144)
# Stand-in ids for the stop and pad tokens, at the top of the vocabulary (no tokenizer is served).
_TOKEN_IDS = {name: PUBLISHED_VOCAB - 1 - i for i, name in enumerate([PAD_TOKEN, *EOS_TOKENS])}


def synthetic_config(layers: int = SYNTHETIC_LAYERS, vocab: int = PUBLISHED_VOCAB, **shapes) -> dict:
    """config.json of the synthetic Beam (`shapes` overrides a published shape: tests shrink it)."""
    from beam_hpu.quant.fp8_checkpoint import beam_fp8_quantization_config

    preset = replace(PUBLISHED, num_hidden_layers=layers, full_every=layers, num_dense_layers=0, **shapes)
    config = config_dict(preset, vocab, _TOKEN_IDS, "bfloat16")
    config["quantization_config"] = beam_fp8_quantization_config().model_dump(mode="json")
    return config


def write_synthetic(out: Path, layers: int = SYNTHETIC_LAYERS, vocab: int = PUBLISHED_VOCAB, **shapes) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(synthetic_config(layers, vocab, **shapes), indent=2) + "\n")
    return out


EXTRAPOLATION = ("MODEL, not a measurement: every part of the synthetic Beam's step scaled by 52 / "
                 f"{SYNTHETIC_LAYERS}; the embedding, LM head and sampling, which do not grow with depth, are "
                 "counted 13 times, so it bounds the published step from above; `card-check --model` on the "
                 "published checkpoint is the card measurement that confirms it")


def extrapolate_step_ms(step_ms: float, layers: int = SYNTHETIC_LAYERS) -> float:
    """The published model's decode step from the synthetic one's, as EXTRAPOLATION says."""
    return step_ms * PUBLISHED_LAYERS / layers
