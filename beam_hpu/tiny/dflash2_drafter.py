"""The tiny DFlash2 drafter of the tiny trained Beam: its layout, its math in plain torch, its files.

The published drafter's layout (see beam_hpu/model/dflash2.py for where each fact comes from) at
the tiny target's sizes: the target's hidden size (it takes the target's embedding and LM head as
they are), query heads covering the hidden size, GQA, two-tap dynamic grouped convolutions around
attention and MLP, a low-rank candidate selector, every layer sliding and non-causal. The files are
what `DFlash2BeamForCausalLM.load_weights` reads: config.json and one safetensors file with the
published names (no embedding, no LM head).

`TinyDFlash2.block` is the block forward the served model computes, from the same plain functions
(`beam_hpu.model.dflash2_ops`), so the trainer optimises what is served.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from beam_hpu.model.dflash2_ops import block_attention, block_mask, grouped_conv, score_edges
from beam_hpu.tiny.drafter import rms_norm, rope

WEIGHTS_FILE = "model.safetensors"
DFLASH2_DIR = Path(__file__).parent / "data" / "trained_dflash2"  # where the trained one is committed
# DFlash's "output of layer j" ids: vLLM's aux ids 1, 3, 5, the EAGLE3 drafter's (drafter.AUX_LAYERS),
# so the target captures the same states for either drafter.
TARGET_LAYER_IDS = (0, 2, 4)
# Tokens 480..511 pad the tiny vocabulary (the tokenizer never produces them): the last is the mask.
MASK_TOKEN_ID = 511
TRAIN_BLOCK = 8  # the published drafter trains with 16 and serves 8; the tiny one halves both
SERVED_DRAFTS = TRAIN_BLOCK - 1  # a served block: the bonus token and 7 drafted ones, as the published serving block of 8


@dataclass(frozen=True)
class DFlash2Shape:
    hidden_size: int = 128          # the target's
    num_hidden_layers: int = 2
    num_attention_heads: int = 4    # 4 x 32 = hidden, as 40 x 128 = 5120 in the published one
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384    # ~3.4 x hidden in the published one (17,408 / 5,120)
    vocab_size: int = 512           # the target's (padded) vocabulary
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    # The published 4,096, not the tiny target's 32: a drafter asked to copy must reach the passage,
    # and every tiny prompt (<= 560 tokens) then fits whole. Not measured against 32: trained either
    # way, the block loss stayed near chance (5.8 nats of 6.2) through the first 60 copy-only steps.
    sliding_window: int = 4096
    conv_kernel_size: int = 2       # the card's two taps
    conv_group_size: int = 16       # the published count (1.93B) implies 16 at rank 256
    selector_rank: int = 16
    selector_top_k: int = 8
    final_logit_softcapping: float = 30.0  # the target's soft-cap
    target_layer_ids: tuple = field(default=TARGET_LAYER_IDS)


def config_json(shape: DFlash2Shape) -> dict:
    s = asdict(shape)
    dflash = {k: s.pop(k) for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                                    "final_logit_softcapping", "target_layer_ids")}
    dflash["target_layer_ids"] = list(dflash["target_layer_ids"])
    dflash["mask_token_id"] = MASK_TOKEN_ID
    return {
        "architectures": ["DFlash2BeamDraftModel"], "model_type": "qwen3", "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "is_causal": False, "use_sliding_window": True,
        "layer_types": ["sliding_attention"] * s["num_hidden_layers"],
        "rope_parameters": {"rope_type": "default", "rope_theta": s.pop("rope_theta")},
        "dflash_config": dflash, "block_size": TRAIN_BLOCK, "dtype": "float32", **s,
    }


class TinyConv(nn.Module):
    def __init__(self, H: int, taps: int, groups: int):
        super().__init__()
        base = torch.zeros(2, taps, H)
        base[:, 0] = 1.0  # starts as the identity on both sides
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(H, 2 * taps * groups, bias=False)
        self.taps, self.groups = taps, groups

    def deltas(self, x: torch.Tensor) -> torch.Tensor:
        R, B, _ = x.shape
        return self.kernel_projection(x).view(R, B, 2, self.taps, self.groups)


class TinyLayer(nn.Module):
    def __init__(self, s: DFlash2Shape):
        super().__init__()
        H, q, kv = s.hidden_size, s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(H, n, bias=False) for n in (q, kv, kv))
        self.o_proj = nn.Linear(q, H, bias=False)
        self.q_norm, self.k_norm = nn.Parameter(torch.ones(s.head_dim)), nn.Parameter(torch.ones(s.head_dim))
        self.gate_proj, self.up_proj = (nn.Linear(H, s.intermediate_size, bias=False) for _ in range(2))
        self.down_proj = nn.Linear(s.intermediate_size, H, bias=False)
        self.input_layernorm, self.post_attention_layernorm = nn.Parameter(torch.ones(H)), nn.Parameter(torch.ones(H))
        groups = H // s.conv_group_size
        self.attention_conv = TinyConv(H, s.conv_kernel_size, groups)
        self.mlp_conv = TinyConv(H, s.conv_kernel_size, groups)


class TinyDFlash2(nn.Module):
    """The drafter's trainable tensors, named as in its checkpoint (`published`)."""

    def __init__(self, shape: DFlash2Shape):
        super().__init__()
        s, H = shape, shape.hidden_size
        self.shape = shape
        self.layers = nn.ModuleList(TinyLayer(s) for _ in range(s.num_hidden_layers))
        self.fc = nn.Linear(len(s.target_layer_ids) * H, H, bias=False)
        self.hidden_norm, self.norm = nn.Parameter(torch.ones(H)), nn.Parameter(torch.ones(H))
        self.predecessor_codebook = nn.Parameter(0.1 * torch.randn(s.vocab_size, s.selector_rank))
        self.successor_codebook = nn.Parameter(0.1 * torch.randn(s.vocab_size, s.selector_rank))
        self.hidden_projection = nn.Linear(H, s.selector_rank, bias=False)

    def published(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().contiguous().clone() for k, v in self._by_name().items()}

    def load_published(self, tensors: dict[str, torch.Tensor]) -> "TinyDFlash2":
        with torch.no_grad():
            for name, param in self._by_name().items():
                param.copy_(tensors[name])
        return self

    def _by_name(self) -> dict[str, nn.Parameter]:
        names = {"fc.weight": self.fc.weight, "hidden_norm.weight": self.hidden_norm, "norm.weight": self.norm,
                 "candidate_selector.predecessor_codebook": self.predecessor_codebook,
                 "candidate_selector.successor_codebook": self.successor_codebook,
                 "candidate_selector.hidden_projection.weight": self.hidden_projection.weight}
        for i, l in enumerate(self.layers):
            p = f"layers.{i}."
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                names[f"{p}self_attn.{n}.weight"] = getattr(l, n).weight
            names[p + "self_attn.q_norm.weight"], names[p + "self_attn.k_norm.weight"] = l.q_norm, l.k_norm
            for n in ("gate_proj", "up_proj", "down_proj"):
                names[f"{p}mlp.{n}.weight"] = getattr(l, n).weight
            names[p + "input_layernorm.weight"] = l.input_layernorm
            names[p + "post_attention_layernorm.weight"] = l.post_attention_layernorm
            for c in ("attention_conv", "mlp_conv"):
                names[f"{p}{c}.base_kernel"] = getattr(l, c).base_kernel
                names[f"{p}{c}.kernel_projection.weight"] = getattr(l, c).kernel_projection.weight
        return names

    def _heads(self, x: torch.Tensor, proj: nn.Linear, norm: torch.Tensor, n: int, positions: torch.Tensor):
        """[R, T, H] -> [R, T, n, D] projected, per-head normed, rotated at positions [R, T]."""
        R, T, _ = x.shape
        y = rms_norm(proj(x).view(R, T, n, -1), norm, self.shape.rms_norm_eps)
        return rope(y.transpose(1, 2), positions, self.shape.rope_theta).transpose(1, 2)

    def context(self, aux: torch.Tensor, positions: torch.Tensor):
        """Target states [R, C, A*H] at positions [R, C] -> per-layer keys, values [L, R, C, Nkv, D]."""
        s = self.shape
        rows = rms_norm(self.fc(aux), self.hidden_norm, s.rms_norm_eps)
        ks = [self._heads(rows, l.k_proj, l.k_norm, s.num_key_value_heads, positions) for l in self.layers]
        vs = [l.v_proj(rows).view(*rows.shape[:2], s.num_key_value_heads, s.head_dim) for l in self.layers]
        return torch.stack(ks), torch.stack(vs)

    def block(self, embeds: torch.Tensor, positions: torch.Tensor, ctx_k, ctx_v, ctx_pos, ctx_valid):
        """Block rows [R, B, H] (embedded bonus + mask tokens) at positions [R, B] -> final-normed [R, B, H]."""
        s = self.shape
        h = embeds
        seen = block_mask(positions, ctx_pos, ctx_valid, s.sliding_window)  # [R, B, C+B]
        for i, l in enumerate(self.layers):
            x = rms_norm(h, l.input_layernorm, s.rms_norm_eps)
            d = l.attention_conv.deltas(x)
            x = grouped_conv(x, l.attention_conv.base_kernel[0], d[:, :, 0])
            q = self._heads(x, l.q_proj, l.q_norm, s.num_attention_heads, positions)
            k = self._heads(x, l.k_proj, l.k_norm, s.num_key_value_heads, positions)
            v = l.v_proj(x).view(*x.shape[:2], s.num_key_value_heads, s.head_dim)
            a = block_attention(q, k, v, ctx_k[i], ctx_v[i], seen, s.head_dim**-0.5)
            a = l.o_proj(a.flatten(2))
            h = h + grouped_conv(a, l.attention_conv.base_kernel[1], d[:, :, 1])
            x = rms_norm(h, l.post_attention_layernorm, s.rms_norm_eps)
            d = l.mlp_conv.deltas(x)
            x = grouped_conv(x, l.mlp_conv.base_kernel[0], d[:, :, 0])
            m = l.down_proj(F.silu(l.gate_proj(x)) * l.up_proj(x))
            h = h + grouped_conv(m, l.mlp_conv.base_kernel[1], d[:, :, 1])
        return rms_norm(h, self.norm, s.rms_norm_eps)

    def edge_scores(self, candidate_ids, unary, hidden, predecessor_ids):
        """Training form of the selector: one known predecessor per position. [R, N, K] ids and
        unary, [R, N, H] rows, [R, N] predecessors -> [R, N, K]: S(pred, b)."""
        R, N, K = candidate_ids.shape
        full = score_edges(self.predecessor_codebook, self.successor_codebook, candidate_ids.reshape(R * N, 1, K),
                           unary.reshape(R * N, 1, K), self.hidden_projection(hidden).reshape(R * N, 1, -1),
                           predecessor_ids.reshape(R * N))
        return full[:, 0, 0].view(R, N, K)


def init_drafter(shape: DFlash2Shape = DFlash2Shape(), seed: int = 0) -> TinyDFlash2:
    """The deterministic random start: the same seed gives the same tensors."""
    torch.manual_seed(seed)
    return TinyDFlash2(shape)


def write_dflash2(out: Path, drafter: TinyDFlash2, meta: dict) -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_json(drafter.shape), indent=2) + "\n")
    save_file(drafter.published(), str(out / WEIGHTS_FILE), metadata={k: str(v) for k, v in meta.items()})
    return out


def read_dflash2(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / WEIGHTS_FILE))


def speculative_config(k: int = SERVED_DRAFTS, path: Path = DFLASH2_DIR) -> str:
    """`vllm serve --speculative-config` for the committed tiny DFlash2 drafter (k drafted tokens a step)."""
    return json.dumps({"method": "dflash", "model": str(path), "num_speculative_tokens": k})
