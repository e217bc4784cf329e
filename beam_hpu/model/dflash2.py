"""Beam's DFlash2 drafter (reflection/Beam-1.0-501B-A23B-DFlash2) for vLLM 0.30.0, plain torch.

DFlash2 drafts a whole block in one forward: the block's rows are the bonus token (the target's
last sampled token) and B-1 mask tokens; they attend non-causally to each other and to the
context, whose keys and values come from Beam's hidden states; each drafted row keeps its top-k
candidates and a low-rank selector walks one path through them. Built from vLLM's layers (so on
Gaudi the linears and norms dispatch to vllm-gaudi's ops); the block arithmetic is in
`dflash2_ops` (plain functions). The context K/V is an explicit input of the block forward: where
it is kept (per request, under the drafter's own 4,096 window) is the proposer's choice.

Where each fact comes from:
- card (huggingface.co/reflection/Beam-1.0-501B-A23B-DFlash2): 1.93B parameters, 5 layers,
  hidden 5120, 40 query / 8 KV heads of 128, SwiGLU 17,408, reads Beam layers 4/16/28/40/46,
  vocabulary shared with Beam, reuses Beam's frozen embedding and LM head, 4,096-token window,
  two-tap dynamic convolutions, block 16 in training / 8 for serving;
- vLLM 0.34 `vllm/models/beam/nvidia/dflash2.py` (read for facts, none of its code used): the
  config fields (`num_hidden_layers`, `hidden_size`, `num_attention_heads`,
  `num_key_value_heads`, `head_dim`, `intermediate_size`, `rms_norm_eps`, `sliding_window`,
  `layer_types` all "sliding_attention", `is_causal` false, `rope_parameters`,
  `max_position_embeddings`, `vocab_size`, and `dflash_config` keys `target_layer_ids`,
  `conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`,
  `final_logit_softcapping`), the weight names (checkpoint names without a `model.` prefix:
  `layers.{i}.self_attn.{q,k,v,o}_proj`, `.q_norm`, `.k_norm`, `layers.{i}.mlp.{gate,up,down}_proj`,
  `layers.{i}.{input,post_attention}_layernorm`, `layers.{i}.{attention,mlp}_conv.base_kernel`
  [2, taps, H] and `.kernel_projection` [2 * taps * G, H], `fc` [H, n * H], `hidden_norm`,
  `norm`, `candidate_selector.{predecessor,successor}_codebook` [V, r] and
  `.hidden_projection` [r, H]; no embedding or LM head), the layer order (norm, conv, attention,
  conv, add, norm, conv, MLP, conv, add; the final `norm`), the context path (fc of the
  concatenated target states, `hidden_norm`, each layer's K/V projection, K-norm and NeoX RoPE at
  the context positions; V as projected), no attention output gate, scale head_dim ** -0.5, the
  soft-capped logits and their top-k as the selector's unary scores; `architectures`
  "DFlash2BeamDraftModel" maps to this class (upstream registry, per the project's REFERENCE.md);
- vLLM 0.34 `dflash2/speculator.py` and `dflash/speculator.py`: block = bonus + N mask tokens at
  the positions after the last accepted one, rows 1..N predict the token at their own position,
  the anchor of the selector is the bonus token; the mask token is `dflash_config.mask_token_id`,
  else the config's top-level `mask_token_id` (`spec_decode/utils.py`
  `get_parallel_drafting_token_id`; `mask_token_id` here);
- vLLM's `AutoWeightsLoader`, which upstream's Beam DFlash2 loads through: it drops checkpoint
  tensors named `rotary_pos_emb.inv_freq`, `rotary_emb.inv_freq`, `rotary_emb.cos_cached` and
  `rotary_emb.sin_cached` (RoPE tables some trainers save; the layer recomputes them);
- vLLM 0.34 `eagle3_utils.get_eagle3_aux_layers_from_config`: DFlash's target_layer_ids name
  layer outputs, vLLM's aux ids are those plus one (`target_aux_layer_ids`).
Fields the AMD variant of the same upstream file reads (`input_embedding_scale`,
`output_multiplier`, `attention_value_scale`, `target_hidden_size`) are not read by the NVIDIA
one; a config that sets the first three to anything but 1 is refused rather than half-served.
Shapes: R requests, B block rows, C context slots, T = rows flattened, L = drafter layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.utils import maybe_prefix

from beam_hpu.location import local_checkpoint_dir
from beam_hpu.model.cpu_fused_norm import beam_rms_norm
from beam_hpu.model.dflash2_ops import (block_attention, block_mask, greedy_walk, grouped_conv, sampled_walk,
                                        score_edges)
from beam_hpu.model.ops import swiglu_fp32

REQUIRED_DFLASH_KEYS = ("target_layer_ids", "conv_kernel_size", "conv_group_size", "selector_rank",
                        "selector_top_k", "final_logit_softcapping")
UNIT_ONLY_KEYS = ("input_embedding_scale", "output_multiplier", "attention_value_scale")
# Checkpoint tensors that are RoPE tables, not parameters: vLLM's AutoWeightsLoader (upstream's Beam
# DFlash2 loader) drops every name containing one; the rotary layer computes its own.
ROTARY_BUFFERS = ("rotary_pos_emb.inv_freq", "rotary_emb.inv_freq", "rotary_emb.cos_cached",
                  "rotary_emb.sin_cached")
UNKNOWN_CONFIG_FILE = "the drafter's config.json"


class DFlash2ConfigError(ValueError):
    pass


def drafter_config_file(model_config: Any) -> str:
    """The drafter's config.json as the launch named the drafter (a directory or a hub id), for errors."""
    model = getattr(model_config, "model", None)
    return f"{model}/config.json" if model else UNKNOWN_CONFIG_FILE


def mask_token_id(config: Any, config_file: str = UNKNOWN_CONFIG_FILE) -> int:
    """The token of a block's drafted rows: `dflash_config.mask_token_id`, else the config's top-level
    `mask_token_id` (upstream's order; a null counts as absent). Every reader of the mask token
    (the model, both proposers) asks here."""
    dc = getattr(config, "dflash_config", None) or {}
    value = dc.get("mask_token_id")
    field = "dflash_config.mask_token_id"
    if value is None:
        value, field = getattr(config, "mask_token_id", None), "mask_token_id"
    if value is None:
        raise DFlash2ConfigError(f"DFlash2 drafter: {config_file} sets neither dflash_config.mask_token_id nor "
                                 "a top-level mask_token_id (the token of the block's drafted rows)")
    vocab = getattr(config, "vocab_size", None)
    if isinstance(value, bool) or not isinstance(value, int) or (vocab is not None and not 0 <= value < vocab):
        raise DFlash2ConfigError(f"DFlash2 drafter: {config_file} {field}={value!r} is not a token id of the "
                                 f"drafter's vocabulary (0..{vocab - 1 if vocab else '?'})")
    return value


def validate_dflash2_config(config: Any, config_file: str = UNKNOWN_CONFIG_FILE) -> None:
    """Refuse a drafter config this module would serve wrongly, naming the field."""
    dc = getattr(config, "dflash_config", None)
    if not isinstance(dc, dict):
        raise DFlash2ConfigError("DFlash2 drafter: config.dflash_config is missing")
    for key in REQUIRED_DFLASH_KEYS:
        if dc.get(key) is None:
            raise DFlash2ConfigError(f"DFlash2 drafter: dflash_config.{key} is missing")
    mask_token_id(config, config_file)
    for key in UNIT_ONLY_KEYS:
        if float(dc.get(key, 1.0)) != 1.0:
            raise DFlash2ConfigError(f"DFlash2 drafter: dflash_config.{key}={dc[key]} is not supported (only 1)")
    layer_types = getattr(config, "layer_types", None) or []
    if len(layer_types) != config.num_hidden_layers or set(layer_types) != {"sliding_attention"}:
        raise DFlash2ConfigError(f"DFlash2 drafter: layer_types must be 'sliding_attention' for each of the "
                                 f"{config.num_hidden_layers} layers, got {layer_types}")
    if getattr(config, "is_causal", False):
        raise DFlash2ConfigError("DFlash2 drafter: is_causal must be false (the block is non-causal)")
    if config.hidden_size % int(dc["conv_group_size"]):
        raise DFlash2ConfigError(f"DFlash2 drafter: dflash_config.conv_group_size={dc['conv_group_size']} does "
                                 f"not divide hidden_size={config.hidden_size}")


def target_aux_layer_ids(config: Any) -> list[int]:
    """vLLM's aux-hidden-state ids for the target (BeamModel's numbering: id i = the input of layer
    i) from DFlash's target_layer_ids (output of layer j): j + 1. Card layers 4/16/28/40/46 ->
    5/17/29/41/47."""
    return [int(j) + 1 for j in config.dflash_config["target_layer_ids"]]


def rope_parameters(config: Any) -> dict:
    """Flat RoPE parameters; a Beam-style config keys them by layer type (drafter layers slide)."""
    params = config.rope_parameters
    return params["sliding_attention"] if "sliding_attention" in params else params


@dataclass
class DFlash2Context:
    """Per-layer context keys/values of each request, as `DFlash2BeamModel.context_kv` made them.

    keys, values [L, R, C, Nkv, D]; positions [R, C]; valid [R, C] (False: padding slot);
    block_valid [R, B] or None: block rows that are keys for the block (False past the model
    length, where the proposer clamps a row's position)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    block_valid: torch.Tensor | None = None


class DFlash2Conv(nn.Module):
    """The dynamic grouped convolution around one sublayer: `prepare` convolves its input and
    returns the delta for its output, `finish` convolves the output (both deltas come from one
    projection of the sublayer's input)."""

    def __init__(self, hidden_size: int, taps: int, group_size: int, prefix: str) -> None:
        super().__init__()
        self.taps, self.groups = taps, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size), requires_grad=False)
        self.kernel_projection = ReplicatedLinear(hidden_size, 2 * taps * self.groups, bias=False,
                                                  prefix=f"{prefix}.kernel_projection", return_bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        R, B, _ = x.shape
        delta = self.kernel_projection(x).view(R, B, 2, self.taps, self.groups)  # [R, B, 2, taps, G]
        return grouped_conv(x, self.base_kernel[0], delta[:, :, 0]), delta[:, :, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return grouped_conv(y, self.base_kernel[1], delta)


class DFlash2BeamAttention(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        if config.num_attention_heads % tp or config.num_key_value_heads % tp:
            raise DFlash2ConfigError(f"DFlash2 drafter: heads ({config.num_attention_heads} / "
                                     f"{config.num_key_value_heads}) do not divide tensor-parallel size {tp}")
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = config.num_key_value_heads // tp
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=False, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=False, prefix=f"{prefix}.o_proj")
        self.q_norm = beam_rms_norm(self.head_dim, config.rms_norm_eps)
        self.k_norm = beam_rms_norm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = get_rope(self.head_dim, max_position=config.max_position_embeddings,
                                   rope_parameters=rope_parameters(config), is_neox_style=True)

    def _rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions, [T, Nq, D] and [T, Nkv, D] normed heads -> both with NeoX RoPE applied.

        One call with a real key, as vLLM's attention layers make it: vllm-gaudi's RotaryEmbedding
        (what this layer is on Gaudi) rotates a query and a key and has no key-less form."""
        T = positions.shape[0]
        q, k = self.rotary_emb(positions, q.reshape(T, self.q_size).contiguous(),
                               k.reshape(T, self.kv_size).contiguous())
        return q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim)

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [T, H], positions [T] -> q [T, Nq, D], k [T, Nkv, D] (normed, rotated), v [T, Nkv, D]."""
        T = x.shape[0]
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._rope(positions, self.q_norm(q.reshape(T, self.num_heads, self.head_dim)),
                          self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim)))
        return q, k, v.reshape(T, self.num_kv_heads, self.head_dim)

    def context_kv(self, normed: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, H] normed context states, [T] positions -> k, v [T, Nkv, D]. The fused projection
        also computes Q for the context rows, discarded: vLLM-CPU repacks unquantised linear
        weights after loading, so the K/V rows of the weight cannot be sliced out here."""
        _, k, v = self._qkv(normed, positions)
        return k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                seen: torch.Tensor) -> torch.Tensor:
        """x [R, B, H] at positions [R, B] over one layer's context keys and values; seen: `block_mask`."""
        R, B, H = x.shape
        q, k, v = self._qkv(x.reshape(R * B, H), positions.reshape(R * B))
        out = block_attention(
            q.view(R, B, self.num_heads, self.head_dim), k.view(R, B, self.num_kv_heads, self.head_dim),
            v.view(R, B, self.num_kv_heads, self.head_dim), ctx_k, ctx_v, seen, self.head_dim**-0.5,
        )  # [R, B, Nq, D]
        out, _ = self.o_proj(out.reshape(R * B, self.q_size))
        return out.view(R, B, H)


class DFlash2BeamMLP(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       bias=False, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False,
                                           prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)  # [R, B, 2I]
        out, _ = self.down_proj(swiglu_fp32(gate_up))
        return out


class DFlash2BeamDecoderLayer(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        dc = config.dflash_config
        taps, group = int(dc["conv_kernel_size"]), int(dc["conv_group_size"])
        self.self_attn = DFlash2BeamAttention(config, prefix=f"{prefix}.self_attn")
        self.mlp = DFlash2BeamMLP(config, prefix=f"{prefix}.mlp")
        self.input_layernorm = beam_rms_norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = beam_rms_norm(config.hidden_size, config.rms_norm_eps)
        self.attention_conv = DFlash2Conv(config.hidden_size, taps, group, prefix=f"{prefix}.attention_conv")
        self.mlp_conv = DFlash2Conv(config.hidden_size, taps, group, prefix=f"{prefix}.mlp_conv")

    def forward(self, residual: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """residual [R, B, H] -> the residual after this layer's two adds."""
        x, delta = self.attention_conv.prepare(self.input_layernorm(residual))
        attn = self.self_attn(x, positions, ctx_k, ctx_v, seen)
        residual = residual + self.attention_conv.finish(attn, delta)
        x, delta = self.mlp_conv.prepare(self.post_attention_layernorm(residual))
        return residual + self.mlp_conv.finish(self.mlp(x), delta)


class DFlash2CandidateSelector(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        dc = config.dflash_config
        rank, self.top_k = int(dc["selector_rank"]), int(dc["selector_top_k"])
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank), requires_grad=False)
        self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank), requires_grad=False)
        self.hidden_projection = ReplicatedLinear(config.hidden_size, rank, bias=False,
                                                  prefix=f"{prefix}.hidden_projection", return_bias=False)

    def forward(self, candidate_ids: torch.Tensor, unary: torch.Tensor, hidden: torch.Tensor,
                anchor_ids: torch.Tensor) -> torch.Tensor:
        """[R, N, K] ids and unary logits, [R, N, H] drafted rows, [R] anchors -> [R, N, K, K]."""
        return score_edges(self.predecessor_codebook, self.successor_codebook, candidate_ids, unary,
                           self.hidden_projection(hidden), anchor_ids)


class DFlash2BeamModel(nn.Module):
    def __init__(self, config: Any, start_layer_id: int = 0, prefix: str = "",
                 config_file: str = UNKNOWN_CONFIG_FILE) -> None:
        super().__init__()
        validate_dflash2_config(config, config_file)
        self.config = config
        n_states = len(config.dflash_config["target_layer_ids"])
        # Replaced by the target's embedding by the proposer (the checkpoint has none).
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=maybe_prefix(prefix, "embed_tokens"))
        # Prefixes numbered after the target's layers, as upstream, so no layer name collides with
        # the target's; the module list (and the checkpoint) counts from 0.
        self.layers = nn.ModuleList([
            DFlash2BeamDecoderLayer(config, prefix=maybe_prefix(prefix, f"layers.{i + start_layer_id}"))
            for i in range(config.num_hidden_layers)
        ])
        self.fc = ReplicatedLinear(config.hidden_size * n_states, config.hidden_size, bias=False,
                                   prefix=maybe_prefix(prefix, "fc"), return_bias=False)
        self.hidden_norm = beam_rms_norm(config.hidden_size, config.rms_norm_eps)
        self.norm = beam_rms_norm(config.hidden_size, config.rms_norm_eps)
        self.candidate_selector = DFlash2CandidateSelector(config, prefix=maybe_prefix(prefix, "candidate_selector"))

    def context_kv(self, combined: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, H] combined target states (`fc` output), [T] positions -> keys, values [L, T, Nkv, D]."""
        normed = self.hidden_norm(combined)
        kv = [layer.self_attn.context_kv(normed, positions) for layer in self.layers]
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: DFlash2Context,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """[R, B] ids (bonus, mask, ...) and positions -> [R, B, H] final-normed hidden states."""
        residual = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)  # [R, B, H]
        seen = block_mask(positions, context.positions, context.valid, self.config.sliding_window,
                          context.block_valid)  # [R, B, C+B], every layer's
        for i, layer in enumerate(self.layers):
            residual = layer(residual, positions, context.keys[i], context.values[i], seen)
        return self.norm(residual)


class DFlash2BeamForCausalLM(nn.Module):
    """vLLM's model class for `DFlash2BeamDraftModel`. Built from the draft config of
    `vllm_config.speculative_config` (or `model_config` when built alone)."""

    has_own_embed_tokens = False
    has_own_lm_head = False

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        spec = getattr(vllm_config, "speculative_config", None)
        if spec is not None:
            model_config = spec.draft_model_config
            start = vllm_config.model_config.get_total_num_hidden_layers()
        else:
            model_config, start = vllm_config.model_config, 0
        config = model_config.hf_config
        self.config = config
        # Where the drafter's files are, as the launch named them: errors name its config and tensors' file.
        self.checkpoint: str | None = getattr(model_config, "model", None)
        self.config_file = drafter_config_file(model_config)
        self.model = DFlash2BeamModel(config, start_layer_id=start, prefix=maybe_prefix(prefix, "model"),
                                      config_file=self.config_file)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.soft_cap = float(config.dflash_config["final_logit_softcapping"])
        self.mask_token_id = mask_token_id(config, self.config_file)

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """[T, n * H] target states (aux ids in order) -> [T, H]."""
        if aux.shape[-1] != self.model.fc.input_size:
            raise ValueError(f"DFlash2 drafter: expects {self.model.fc.input_size} concatenated target "
                             f"features, got {aux.shape[-1]} (target_layer_ids do not match the target)")
        return self.model.fc(aux)

    def context_kv(self, combined: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.context_kv(combined, positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: DFlash2Context,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, context, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> fp32 soft-capped logits [..., V]."""
        logits = self.logits_processor(self.lm_head, hidden).float()
        return torch.tanh(logits / self.soft_cap) * self.soft_cap

    def compute_candidates(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., H] -> top-k ids and their soft-capped logits, [..., K] each (cap is monotonic)."""
        values, ids = self.compute_logits(hidden).topk(self.model.candidate_selector.top_k, dim=-1)
        return ids, values

    def edge_scores(self, hidden: torch.Tensor, anchor_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[R, B, H] block output, [R] bonus tokens -> the selector's edge scores [R, B-1, K, K] and
        candidate ids [R, B-1, K] (rows 1..B-1 predict the tokens at their own positions)."""
        drafted = hidden[:, 1:]
        ids, unary = self.compute_candidates(drafted)
        return self.model.candidate_selector(ids, unary, drafted, anchor_ids), ids

    def draft_greedy(self, hidden: torch.Tensor, anchor_ids: torch.Tensor):
        """-> drafted tokens [R, B-1], the score rows the walk read [R, B-1, K] and candidate ids."""
        scores, ids = self.edge_scores(hidden, anchor_ids)
        tokens, rows = greedy_walk(scores, ids)
        return tokens, rows, ids

    def draft_sampled(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, temperature: torch.Tensor,
                      noise: torch.Tensor):
        """The walk sampled at each request's temperature [R] with exponential `noise` [R, B-1, K]:
        drafted tokens [R, B-1], the distributions they were drawn from over their candidates
        [R, B-1, K], and the candidate ids [R, B-1, K]."""
        scores, ids = self.edge_scores(hidden, anchor_ids)
        tokens, dists = sampled_walk(scores, ids, temperature, noise)
        return tokens, dists, ids

    # Checkpoint name part -> (parameter name part, shard id).
    stacked_params_mapping = [
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Published names (no `model.` prefix) -> this module's parameters. RoPE tables some
        checkpoints carry (`ROTARY_BUFFERS`) are skipped, as upstream skips them; every other name
        must land on a parameter. The embedding and LM head are the target's, so they count as loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            if any(buffer in ckpt_name for buffer in ROTARY_BUFFERS):
                continue
            name = "model." + ckpt_name.removeprefix("model.")
            for param_part, ckpt_part, shard in self.stacked_params_mapping:
                if ckpt_part in name:
                    target = name.replace(ckpt_part, param_part)
                    self._param(params, target, ckpt_name).weight_loader(params[target], tensor, shard)
                    break
            else:
                target = name
                param = self._param(params, target, ckpt_name)
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(target)
        return loaded | {"model.embed_tokens.weight", "lm_head.weight"}

    def _param(self, params: dict, target: str, ckpt_name: str) -> nn.Parameter:
        if target not in params:
            raise KeyError(f"DFlash2 drafter: checkpoint tensor {ckpt_name!r} in "
                           f"{tensor_file(self.checkpoint, ckpt_name)} has no parameter (looked for {target!r})")
        return params[target]


def tensor_file(checkpoint: str | None, name: str) -> str:
    """The safetensors file of `checkpoint` (a directory, or a hub id in the local cache) that holds
    tensor `name`, read from headers only; else what is known of where it came from."""
    directory = local_checkpoint_dir(checkpoint)
    if directory is None:
        return f"the drafter checkpoint {checkpoint}" if checkpoint else "the drafter checkpoint"
    from safetensors import safe_open

    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
        if name in keys:
            return str(path)
    return f"the drafter checkpoint {directory}"
