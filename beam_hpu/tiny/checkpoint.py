"""Tiny, deterministic Beam checkpoints in the published layout, for tests and the CPU demo.

A tiny checkpoint is complete: `config.json` (Beam's real layer pattern scaled down: both attention
kinds, dense then sparse MLPs, several expert groups, a small window), sharded safetensors with an
index, weights named as the published checkpoint names them (per-expert
`mlp.experts.{e}.{gate,up,down}_proj.weight`, fp32 router), a small byte-level BPE tokenizer with
Beam's control tokens, the chat template, `response_template` in `tokenizer_config.json`, and
`generation_config.json`. The same preset and seed always give the same bytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from beam_hpu.model.config import default_mlp_layer_types
from beam_hpu.names import MODEL_TYPE
from beam_hpu.parsers.template import BUNDLED_TEMPLATE, bundled_template

DATA = Path(__file__).parent / "data"
# The committed tiny trained Beam: `python -m beam_hpu.tiny.train beam_hpu/tiny/data/trained_tiny` writes it.
TRAINED_DIR = DATA / "trained_tiny"

# The tiny tokenizer's special tokens: Qwen's `<|endoftext|>` (it pads), then the response
# template's control tokens. Which control tokens exist is the template's word; this tuple only
# fixes their ids (the committed tokenizer's order), and the check below keeps the two in step.
PAD_TOKEN = "<|endoftext|>"
CONTROL_TOKENS = [PAD_TOKEN, "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>",
                  "<|return|>"]
if set(CONTROL_TOKENS[1:]) != set(bundled_template().control_tokens):
    raise AssertionError(f"the tiny tokenizer's control tokens {CONTROL_TOKENS[1:]} are not the response "
                         f"template's {bundled_template().control_tokens}")
# Generation stops at the closers that end an output (an answer, the last call), and at the pad.
EOS_TOKENS = [*bundled_template().content_closers[:1], *bundled_template().call_closers[:1], PAD_TOKEN]


@dataclass(frozen=True)
class TinyPreset:
    """The shape of a tiny Beam. `full_every`: every n-th layer is full attention, and the last."""

    hidden_size: int = 64
    num_hidden_layers: int = 6
    full_every: int = 3
    num_dense_layers: int = 1
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32  # vLLM's CPU attention supports 32 and up, not 16
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    n_group: int = 4
    topk_group: int = 2
    sliding_window: int = 16
    final_logit_softcapping: float = 10.0
    routed_scaling_factor: float = 2.5
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    extra: dict = field(default_factory=dict)

    def layer_types(self) -> list[str]:
        n = self.num_hidden_layers
        kinds = ["full_attention" if (i + 1) % self.full_every == 0 else "sliding_attention" for i in range(n)]
        kinds[-1] = "full_attention"
        return kinds


PRESETS = {
    # The default: 6 layers (SWA, SWA, full, SWA, SWA, full), 8 experts in 4 groups, window 16.
    "small": TinyPreset(),
    # A second shape for the oracle tests: other window (not a power of two), more heads per KV
    # head, 16 experts in 8 groups keeping 3, top-4, 2 dense layers, the published soft-cap.
    "wide": TinyPreset(
        hidden_size=96,
        num_hidden_layers=5,
        full_every=4,
        num_dense_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=160,
        moe_intermediate_size=48,
        num_experts=16,
        num_experts_per_tok=4,
        n_group=8,
        topk_group=3,
        sliding_window=24,
        final_logit_softcapping=30.0,
    ),
    # The tiny *trained* Beam (beam_hpu/tiny/train.py): wider, so it can learn to copy and retrieve;
    # layers SWA, SWA, full, SWA, full with window 32, so needles sit many windows back.
    "trained": TinyPreset(
        hidden_size=128,
        num_hidden_layers=5,
        intermediate_size=256,
        moe_intermediate_size=64,
        sliding_window=32,
        final_logit_softcapping=30.0,
    ),
}


def preset(name: str, **overrides) -> TinyPreset:
    if name not in PRESETS:
        raise ValueError(f"unknown tiny preset {name!r}; choose from {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _corpus() -> list[str]:
    """Deterministic training text: enough English, digits, JSON and Beam markup for short BPE."""
    words = (
        "the model reads a passage and writes an answer . we check each token of the output "
        "against the reference , and the tool call returns the weather in Paris for two days . "
        "numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 , code def return print if else for in "
        "analysis final xml to= name city days unit celsius fahrenheit search query result "
        "hello world please think step by step then answer briefly . yes no true false null "
    ).split()
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 7)]
    lines += [
        '<rfl:parameter name="city">\nParis\n</rfl:parameter>',
        '{"city": "Paris", "days": 2, "ok": true, "list": [1, 2, 3]}',
        "assistant to=get_weather",
        "user system developer tool",
    ]
    return lines * 4


def build_tokenizer():
    """A byte-level BPE (any text encodes) with Beam's control tokens as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=480,
        special_tokens=CONTROL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def write_tokenizer(out: Path) -> int:
    """Write tokenizer files, chat template and response template; return the vocabulary size."""
    from transformers import PreTrainedTokenizerFast

    tok = build_tokenizer()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=CONTROL_TOKENS[1:],
    )
    fast.chat_template = (DATA / "chat_template.jinja").read_text()
    fast.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    # The checkpoint describes its own output format; the `beam` parsers and grammar read it.
    cfg["response_template"] = json.loads(BUNDLED_TEMPLATE.read_text())
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return tok.get_vocab_size()


# ---------------------------------------------------------------------------------------------
# Config and weights


def config_dict(p: TinyPreset, vocab_size: int, token_ids: dict[str, int], dtype: str) -> dict:
    # Vocab padded to a multiple of 64, as real checkpoints pad theirs (151,936 = 2374 * 64).
    padded_vocab = math.ceil(vocab_size / 64) * 64
    cfg = {
        "architectures": ["BeamForCausalLM"],
        "model_type": MODEL_TYPE,
        "vocab_size": padded_vocab,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "sliding_window": p.sliding_window,
        "layer_types": p.layer_types(),
        "mlp_layer_types": default_mlp_layer_types(p.num_hidden_layers)
        if p.num_dense_layers == 3
        else ["dense"] * p.num_dense_layers + ["sparse"] * (p.num_hidden_layers - p.num_dense_layers),
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": p.rope_theta},
            "full_attention": None,
        },
        "moe_intermediate_size": p.moe_intermediate_size,
        "num_experts": p.num_experts,
        "num_experts_per_tok": p.num_experts_per_tok,
        "n_group": p.n_group,
        "topk_group": p.topk_group,
        "norm_topk_prob": True,
        "routed_scaling_factor": p.routed_scaling_factor,
        "final_logit_softcapping": p.final_logit_softcapping,
        "bos_token_id": None,
        "eos_token_id": [token_ids[t] for t in EOS_TOKENS],
        "pad_token_id": token_ids["<|endoftext|>"],
        "dtype": dtype,
    }
    cfg.update(p.extra)
    return cfg


# A post-norm gain that makes the random tiny Beam well-conditioned enough for accuracy tests.
# The sandwich post-norms (`post_attention_layernorm`, `post_feedforward_layernorm`) scale each
# residual branch; at the random init's gain of ~1 the tiny model is chaotic: a rounding difference
# flips an expert choice and moves the logits so much that bf16 vs fp32 alone gives KL ~0.05 and
# top-1 agreement ~83%, which drowns the FP8 effects an accuracy test means to measure. Scaling
# those norm weights by 0.1 brings bf16 vs fp32 to KL ~0.0007. The default (None) is unchanged.
CONDITIONED_POST_NORM_GAIN = 0.1
POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")


def random_state_dict(cfg: dict, seed: int, dtype, post_norm_gain: float | None = None) -> dict:
    """Published tensor names and shapes, random values with enough spread that every part of the
    model (norm weights, gate bias, correction bias, soft-cap) visibly changes the logits.

    `post_norm_gain` multiplies the post-norm weights (see CONDITIONED_POST_NORM_GAIN); every other
    tensor, and the random stream, is the same as without it."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std=1.0, mean=0.0, dt=None):
        return (torch.randn(*shape, generator=g, dtype=torch.float32) * std + mean).to(dt or dtype)

    H, D = cfg["hidden_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    I, Im, E = cfg["intermediate_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    sd = {"model.embed_tokens.weight": normal(cfg["vocab_size"], H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            w = normal(H, std=0.1, mean=1.0, dt=torch.float32)
            if post_norm_gain is not None and norm in POST_NORMS:
                w = w * post_norm_gain
            sd[f"{p}.{norm}.weight"] = w.to(dtype)
        a = f"{p}.self_attn"
        sd[f"{a}.q_proj.weight"] = normal(nq * D, H, std=H**-0.5)
        sd[f"{a}.k_proj.weight"] = normal(nkv * D, H, std=H**-0.5)
        sd[f"{a}.v_proj.weight"] = normal(nkv * D, H, std=H**-0.5)
        sd[f"{a}.o_proj.weight"] = normal(H, nq * D, std=(nq * D) ** -0.5)
        sd[f"{a}.q_norm.weight"] = normal(D, std=0.1, mean=1.0)
        sd[f"{a}.k_norm.weight"] = normal(D, std=0.1, mean=1.0)
        sd[f"{a}.gate_proj.weight"] = normal(nq * D, H, std=H**-0.5)
        sd[f"{a}.gate_bias"] = normal(nq, std=0.5)
        m = f"{p}.mlp"
        if cfg["mlp_layer_types"][i] == "dense":
            sd[f"{m}.gate_proj.weight"] = normal(I, H, std=H**-0.5)
            sd[f"{m}.up_proj.weight"] = normal(I, H, std=H**-0.5)
            sd[f"{m}.down_proj.weight"] = normal(H, I, std=I**-0.5)
        else:
            # The router stays fp32 in the published checkpoint (and is never quantised).
            sd[f"{m}.gate.weight"] = normal(E, H, std=H**-0.5, dt=torch.float32)
            sd[f"{m}.gate.e_score_correction_bias"] = normal(E, std=0.05, dt=torch.float32)
            for e in range(E):
                x = f"{m}.experts.{e}"
                sd[f"{x}.gate_proj.weight"] = normal(Im, H, std=H**-0.5)
                sd[f"{x}.up_proj.weight"] = normal(Im, H, std=H**-0.5)
                sd[f"{x}.down_proj.weight"] = normal(H, Im, std=Im**-0.5)
    sd["model.norm.weight"] = normal(H, std=0.1, mean=1.0)
    sd["lm_head.weight"] = normal(cfg["vocab_size"], H, std=2.0 * H**-0.5)
    return sd


def write_tiny_checkpoint(
    out: str | Path,
    preset_name: str = "small",
    *,
    dtype: str = "bfloat16",
    seed: int = 0,
    num_shards: int = 3,
    state_dict=None,
    post_norm_gain: float | None = None,
    **overrides,
) -> Path:
    """Write a complete tiny Beam checkpoint to `out` and return its path.

    `state_dict` replaces the random weights (e.g. a trained tiny Beam); names must be published.
    `post_norm_gain` conditions the random weights (see CONDITIONED_POST_NORM_GAIN).
    """
    import torch

    from beam_hpu.loader.checkpoint import write_shards

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    p = preset(preset_name, **overrides)
    vocab = write_tokenizer(out)
    token_ids = build_tokenizer().get_vocab()
    cfg = config_dict(p, vocab, token_ids, dtype)
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    if state_dict is not None and post_norm_gain is not None:
        raise ValueError("post_norm_gain applies to the random weights; it cannot be combined with state_dict")
    sd = state_dict if state_dict is not None else random_state_dict(cfg, seed, torch_dtype, post_norm_gain)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"],
           "temperature": 0.7, "top_p": 0.99}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_shards(sd, out, num_shards)
    recipe = {"preset": preset_name, "seed": seed, "dtype": dtype, **asdict(p)}
    if post_norm_gain is not None:
        recipe["post_norm_gain"] = post_norm_gain
    (out / "beam_tiny.json").write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
    return out
