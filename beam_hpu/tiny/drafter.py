"""The tiny EAGLE3 drafter of the tiny trained Beam: its shape, its math in plain torch, its files.

The files are what vLLM 0.30.0's EAGLE3 loader reads (`Eagle3LlamaForCausalLM`, architecture
`LlamaForCausalLMEagle3`): a Llama-style config.json and one safetensors file with `fc`, one decoder
layer (`layers.0.*`, with `hidden_norm`), `norm` and `lm_head`. No `embed_tokens`: vLLM then gives
the drafter the target's embedding (`_maybe_share_embeddings`), which is also what it trains with.

`DraftLayer.forward` is the computation vLLM runs for one drafting step, written here from its
definition (not from vLLM's code) so the trainer optimises exactly what is served:
  x   = cat(input_norm(embed(token)), hidden_norm(h))           [T, 2H]
  r1  = h + o_proj(attention(qkv_proj(x)))                     (RoPE, causal, GQA)
  r2  = r1 + mlp(post_attention_norm(r1))                      (SwiGLU)
  logits = lm_head(norm(r2)); the next step's h is r2.
On the first step h = fc(cat(aux states of the target at `AUX_LAYERS`)) at the token's previous
position; later steps feed the drafter's own r2.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# vLLM's aux ids of the 5-layer tiny Beam (see BeamModel.forward): the stream after layer 0, after
# layer 2 (past the first full-attention layer), and the last layer's output before the final norm.
AUX_LAYERS = (1, 3, 5)
WEIGHTS_FILE = "model.safetensors"
DRAFTER_DIR = Path(__file__).parent / "data" / "trained_drafter"  # the committed one


@dataclass(frozen=True)
class DrafterShape:
    hidden_size: int = 128        # the target's: the drafter takes the target's embedding as is
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    vocab_size: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096


# 4: on copy at 1 stream (fp32, benchmarks/spec_decode.py) k = 3, 4, 5 were measured in one run;
# 4 was fastest (benchmarks/README.md, spec_decode, gives the figures).
SERVED_SPECULATIVE_TOKENS = 4


def speculative_config(k: int = SERVED_SPECULATIVE_TOKENS, path: Path = DRAFTER_DIR) -> str:
    """`vllm serve --speculative-config` for the committed drafter (EAGLE3, k drafted tokens per step)."""
    return json.dumps({"method": "eagle3", "model": str(path), "num_speculative_tokens": k})


def config_json(shape: DrafterShape) -> dict:
    s = asdict(shape)
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "draft_vocab_size": s["vocab_size"], "target_hidden_size": s["hidden_size"],
        "rope_parameters": {"rope_type": "default", "rope_theta": s.pop("rope_theta")},
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_LAYERS), "use_aux_hidden_state": True},
        "dtype": "float32", **s,
    }


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (halves rotated), x [..., T, D], positions [T] or [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = positions.float()[..., None] * inv  # [.., T, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    if cos.dim() == 3:  # [B, T, D] -> [B, 1, T, D] against [B, heads, T, D]
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Drafter(nn.Module):
    """The drafter's trainable tensors, named as in its checkpoint."""

    def __init__(self, shape: DrafterShape, aux_count: int = len(AUX_LAYERS)):
        super().__init__()
        H, q, kv = shape.hidden_size, shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
        self.shape = shape
        self.fc = nn.Linear(aux_count * H, H, bias=False)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(2 * H, n, bias=False) for n in (q, kv, kv))
        self.o_proj = nn.Linear(q, H, bias=False)
        self.gate_proj, self.up_proj = (nn.Linear(H, shape.intermediate_size, bias=False) for _ in range(2))
        self.down_proj = nn.Linear(shape.intermediate_size, H, bias=False)
        self.input_layernorm, self.hidden_norm, self.post_attention_layernorm, self.norm = (
            nn.Parameter(torch.ones(H)) for _ in range(4))
        self.lm_head = nn.Linear(H, shape.vocab_size, bias=False)

    def published(self) -> dict[str, torch.Tensor]:
        p = "layers.0."
        names = {"fc.weight": self.fc.weight, "norm.weight": self.norm, "lm_head.weight": self.lm_head.weight,
                 p + "input_layernorm.weight": self.input_layernorm, p + "hidden_norm.weight": self.hidden_norm,
                 p + "post_attention_layernorm.weight": self.post_attention_layernorm}
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[f"{p}self_attn.{n}.weight"] = getattr(self, n).weight
        for n in ("gate_proj", "up_proj", "down_proj"):
            names[f"{p}mlp.{n}.weight"] = getattr(self, n).weight
        return {k: v.detach().float().contiguous().clone() for k, v in names.items()}

    def qkv(self, embeds: torch.Tensor, h: torch.Tensor, positions: torch.Tensor):
        """[B, T, H] token embeddings and incoming states -> q [B, Nq, T, D], k, v [B, Nkv, T, D]."""
        s = self.shape
        eps = s.rms_norm_eps
        x = torch.cat([rms_norm(embeds, self.input_layernorm, eps), rms_norm(h, self.hidden_norm, eps)], -1)
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, s.num_attention_heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, s.num_key_value_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, s.num_key_value_heads, s.head_dim).transpose(1, 2)
        return rope(q, positions, s.rope_theta), rope(k, positions, s.rope_theta), v

    def finish(self, h: torch.Tensor, attn: torch.Tensor):
        """Incoming states [B, T, H] and attention output [B, Nq, T, D] -> (logits, next states r2)."""
        B, _, T, _ = attn.shape
        r1 = h + self.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        x = rms_norm(r1, self.post_attention_layernorm, self.shape.rms_norm_eps)
        r2 = r1 + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.lm_head(rms_norm(r2, self.norm, self.shape.rms_norm_eps)), r2


def unrolled_logits(drafter: Drafter, embed: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor, steps: int):
    """Training-time test: the drafter run `steps` drafting steps from every position at once.

    ids [B, L] tokens, aux [B, L, A*H] the target's aux states. Chain p starts at position p with
    (token ids[p + 1], fc(aux[p])); its step j sits at position p + j with token ids[p + 1 + j] and
    the step j - 1 output, and attends to what the served drafter's KV cache holds then: step-0 keys
    of positions 0..p and its own chain's keys of steps 1..j. Returns one [B, L, V] per step (the
    last j positions of step j are past the sequence; callers mask them)."""
    B, L = ids.shape
    s = drafter.shape
    rep = s.num_attention_heads // s.num_key_value_heads
    scale = s.head_dim ** -0.5
    pos = torch.arange(L)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    h = drafter.fc(aux)
    keys, values, out = [], [], []
    for j in range(steps):
        tok = torch.cat([ids[:, 1 + j:], ids.new_zeros(B, 1 + j)], 1)  # ids[p + 1 + j], 0 past the end
        q, k, v = drafter.qkv(F.embedding(tok, embed), h, pos + j)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        keys.append(k)
        values.append(v)
        s0 = (q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))  # [B, Nq, L, L]
        diag = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys[1:]]  # own chain, [B, Nq, L, 1] each
        w = torch.softmax(torch.cat([s0, *diag], -1), -1)
        attn = w[..., :L] @ values[0]
        for i, vv in enumerate(values[1:]):
            attn = attn + w[..., L + i: L + i + 1] * vv
        logits, h = drafter.finish(h, attn)
        out.append(logits)
    return out


def write_drafter(out: Path, drafter: Drafter, meta: dict) -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_json(drafter.shape), indent=2) + "\n")
    save_file(drafter.published(), str(out / WEIGHTS_FILE), metadata={k: str(v) for k, v in meta.items()})
    return out


def read_drafter(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / WEIGHTS_FILE))
