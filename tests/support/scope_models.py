"""Tiny non-Beam checkpoints for tests/runtime/test_scope.py, written by transformers' own model
classes with random weights: a Llama (dense), a Qwen3-MoE (routed experts) and a Qwen2-MoE
(routed plus shared experts), each unquantised or as compressed-tensors FP8 the way
beam_hpu.quant.fp8_checkpoint writes Beam (FP8_DYNAMIC: channel weights, per-token activations).
No tokenizer: the engines run with skip_tokenizer_init and token ids."""
from __future__ import annotations

import tempfile
from pathlib import Path

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
              max_position_embeddings=1024, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[])
# Left unquantised, as for Beam: the head, the embeddings, the router (vLLM builds it without a
# quant method) and Qwen2-MoE's one-output shared-expert gate (likewise).
FP8_IGNORE = ["lm_head", "model.embed_tokens", "re:.*mlp[.]gate$", "re:.*shared_expert_gate$"]


def _config(kind: str):
    from transformers import LlamaConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if kind == "llama":
        return LlamaConfig(intermediate_size=128, head_dim=32, **COMMON)
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(intermediate_size=128, head_dim=32, **MOE, **COMMON)
    if kind == "qwen2_moe":
        return Qwen2MoeConfig(intermediate_size=128, shared_expert_intermediate_size=64, **MOE, **COMMON)
    raise ValueError(f"unknown tiny model kind {kind!r}")


def write_tiny(out: Path, kind: str, *, fp8: bool = False, seed: int = 0) -> Path:
    """Write the tiny `kind` checkpoint to `out` (FP8 compressed-tensors if `fp8`); return `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    from beam_hpu.quant.fp8_checkpoint import quantize_checkpoint

    config = _config(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    if not fp8:
        model.save_pretrained(out)
        return out
    with tempfile.TemporaryDirectory(prefix=f"tiny-{kind}-src-") as src:
        model.save_pretrained(src)
        return quantize_checkpoint(src, out, FP8_IGNORE)
