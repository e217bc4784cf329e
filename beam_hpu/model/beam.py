"""Inference-only Beam-1.0 for vLLM 0.30.0, compatible with the published HuggingFace weights.

Beam is a decoder-only MoE transformer:
- attention: GQA with per-head Q/K RMSNorm; sliding-window layers use RoPE, full-attention layers
  use no positional encoding (NoPE) and scale queries with SSMax; the attention output is
  multiplied by sigmoid(gate_proj(x) + gate_bias[head]) before o_proj;
- each block: sandwich norms (a norm before and after attention and the MLP) and depth-scaled
  residual adds h = f / sqrt(k) + r * sqrt((k - 1) / k), with k counting residual adds;
- MLP: the first layers are dense SwiGLU, the rest a grouped top-k MoE with an fp32 sigmoid
  router, a score-correction bias used only for selection, and a routed scaling factor;
- logits: final soft-cap c * tanh(logits / c).

Built only from vLLM's own layers (parallel linears, Attention with a per-layer sliding window,
FusedMoEFactory, vocab-parallel embedding / LM head), so on Gaudi each dispatches to vllm-gaudi's
ops and attention backend and here to vLLM's CPU ones. Shapes: T = tokens in the step, H = hidden,
D = head_dim, Nq / Nkv = local query / KV heads, E = experts.
"""

# No `from __future__ import annotations`: the torch-compile decorator reads real forward annotations.

import math
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe import FusedMoEFactory
from vllm.model_executor.layers.fused_moe.layer import fused_moe_make_expert_params_mapping
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3, SupportsPP
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    extract_layer_index,
    is_pp_missing_parameter,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.sequence import IntermediateTensors

from beam_hpu.model.cpu_fused_norm import beam_rms_norm
from beam_hpu.model.config import validate_beam_config
from beam_hpu.model.ops import swiglu_fp32

# SSMax for NoPE layers: queries at position p are scaled by (1 + (p + 1) / L) ** power. These two
# constants are not in config.json (transformers and llama.cpp hard-code them the same way).
SSMAX_POWER = 0.1
SSMAX_LENGTH = 2048.0
# A checkpoint's per-layer FP8 KV-cache scale: model.layers.{i}.self_attn.{q,k,v}_scale.
KV_CACHE_SCALE = re.compile(r"\.self_attn\.([qkv])_scale$")


def ssmax_query_scale(positions: torch.Tensor) -> torch.Tensor:
    """[T] positions -> [T, 1, 1] fp32 query scale for NoPE (full-attention) layers."""
    return torch.exp(SSMAX_POWER * torch.log1p((positions.float() + 1.0) / SSMAX_LENGTH))[:, None, None]


def depth_scaled_norm_eps(eps: float, add_index: int) -> float:
    """The eps that makes RMSNorm of the un-scaled residual sum equal Beam's norm of its stream.

    Beam's k-th residual add is h_k = u / sqrt(k) + h_{k-1} * sqrt((k-1)/k) (k counts adds from the
    embedding, h_1). With g_k = sqrt(k) * h_k this is a plain sum, g_k = u + g_{k-1}, and
    RMSNorm(h_k, eps) = RMSNorm(g_k / sqrt(k), eps) = RMSNorm(g_k, k * eps) exactly. So the model
    carries g and scales each norm's eps instead: the adds fuse into vLLM's add+RMSNorm, as in
    every other vLLM decoder, instead of three extra element-wise ops per add.
    """
    return eps * add_index


class BeamMLP(nn.Module):
    """Dense SwiGLU MLP (Beam's first layers)."""

    def __init__(self, hidden_size: int, intermediate_size: int, quant_config: QuantizationConfig | None,
                 prefix: str = "") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=False, quant_config=quant_config, prefix=f"{prefix}.down_proj",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)  # [T, 2I/tp]
        out, _ = self.down_proj(swiglu_fp32(gate_up))
        return out


class BeamRouter(nn.Module):
    """[T, H] -> [T, E] fp32 router logits, never quantised (the checkpoint stores it in fp32).

    A plain module on purpose, not vLLM's GateLinear: on CPU, vLLM 0.30.0 repacks every unquantised
    linear's weight and leaves an empty tensor of the default dtype behind, so GateLinear's fp32
    path then casts bf16 activations for an fp32 kernel and returns garbage (NaN in bf16 serving).
    """

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        # The (output, bias) pair is the linear-layer convention the MoE runner unpacks.
        return F.linear(x.float(), self.weight), None


class BeamMoE(nn.Module):
    """Grouped top-k MoE: fp32 sigmoid router + correction bias (selection only), E experts in
    `n_group` groups, keep `topk_group` groups by the sum of their top-2 biased scores, top-k within
    them, weights from the unbiased scores renormalised and scaled by `routed_scaling_factor`."""

    def __init__(self, config, quant_config: QuantizationConfig | None, prefix: str = "") -> None:
        super().__init__()
        self.gate = BeamRouter(config.hidden_size, config.num_experts)
        self.experts = FusedMoEFactory(
            gate=self.gate,
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            renormalize=config.norm_topk_prob,
            use_grouped_topk=True,
            num_expert_group=config.n_group,
            topk_group=config.topk_group,
            scoring_func="sigmoid",
            e_score_correction_bias=self.gate.e_score_correction_bias,
            routed_scaling_factor=config.routed_scaling_factor,
            activation="silu",
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(-1, shape[-1])  # [T, H]; vllm-gaudi's prefill hands 3-D [B, S, H]
        # With `gate=` the runner computes the router logits itself from the hidden states.
        return self.experts(hidden_states=x, router_logits=x).view(shape)


class BeamAttention(nn.Module):
    def __init__(self, config, cache_config: CacheConfig | None, quant_config: QuantizationConfig | None,
                 prefix: str = "") -> None:
        super().__init__()
        layer_idx = extract_layer_index(prefix)
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = config.num_key_value_heads
        if self.total_num_heads % tp_size:
            raise ValueError(f"Beam: num_attention_heads ({self.total_num_heads}) is not divisible by the "
                             f"tensor-parallel size ({tp_size})")
        if self.total_num_kv_heads % tp_size and tp_size % self.total_num_kv_heads:
            raise ValueError(f"Beam: num_key_value_heads ({self.total_num_kv_heads}) and the tensor-parallel "
                             f"size ({tp_size}) must divide one another")
        self.num_heads = self.total_num_heads // tp_size
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, self.total_num_heads, self.total_num_kv_heads, bias=False,
            quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )
        # The output gate has one row per query channel, so it shards with the query heads. Its
        # per-head bias is held as the linear's bias, repeated over head_dim, so it rides in the GEMM.
        self.gate_proj = ColumnParallelLinear(
            config.hidden_size, self.total_num_heads * self.head_dim, bias=True, quant_config=quant_config,
            prefix=f"{prefix}.gate_proj",
        )
        self.gate_proj.bias.weight_loader = self._load_gate_bias
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim, config.hidden_size, bias=False, quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.q_norm = beam_rms_norm(self.head_dim, config.rms_norm_eps)
        self.k_norm = beam_rms_norm(self.head_dim, config.rms_norm_eps)

        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        if self.is_sliding:
            self.rotary_emb = get_rope(
                self.head_dim, max_position=config.max_position_embeddings,
                rope_parameters=config.rope_parameters["sliding_attention"], is_neox_style=True,
            )
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
            cache_config=cache_config, quant_config=quant_config,
            # None on full layers: vLLM would otherwise fall back to cache_config.sliding_window.
            per_layer_sliding_window=config.sliding_window if self.is_sliding else None,
            prefix=f"{prefix}.attn",
        )

    def _load_gate_bias(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Checkpoint `gate_bias` [Nq_total] -> this rank's [Nq * D] linear bias."""
        rank = get_tensor_model_parallel_rank()
        per_head = loaded.narrow(0, rank * self.num_heads, self.num_heads)
        param.data.copy_(per_head.repeat_interleave(self.head_dim).to(param.dtype))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ssmax_scale: torch.Tensor) -> torch.Tensor:
        # vllm-gaudi hands a prompt batch as [B, S, H] (positions [B, S]) unless the model type is in
        # its flatten_input list, which Beam's is not; rows are rows here, so take them flat.
        lead = x.shape[:-1]
        x, positions = x.reshape(-1, x.shape[-1]), positions.reshape(-1)
        T = x.shape[0]
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim))  # [T, Nq, D]
        k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim))  # [T, Nkv, D]
        if self.is_sliding:
            q, k = self.rotary_emb(positions, q.reshape(T, self.q_size), k.reshape(T, self.kv_size))
        else:
            q = (q.float() * ssmax_scale).to(v.dtype)
        out = self.attn(q.reshape(T, self.q_size), k.reshape(T, self.kv_size), v)  # [T, Nq*D]
        gate, _ = self.gate_proj(x)  # [T, Nq*D], per-head bias included
        out = out * torch.sigmoid(gate)
        out, _ = self.o_proj(out)
        return out.view(*lead, out.shape[-1])


class BeamDecoderLayer(nn.Module):
    """Sandwich norms around attention and the MLP; see `depth_scaled_norm_eps` for the residual."""

    def __init__(self, config, cache_config: CacheConfig | None, quant_config: QuantizationConfig | None,
                 prefix: str = "") -> None:
        super().__init__()
        layer_idx = extract_layer_index(prefix)
        self.self_attn = BeamAttention(config, cache_config, quant_config, prefix=f"{prefix}.self_attn")
        if config.mlp_layer_types[layer_idx] == "sparse":
            self.mlp = BeamMoE(config, quant_config, prefix=f"{prefix}.mlp")
        else:
            self.mlp = BeamMLP(config.hidden_size, config.intermediate_size, quant_config, prefix=f"{prefix}.mlp")
        eps, H = config.rms_norm_eps, config.hidden_size
        # Layer i's attention output is residual add 2(i+1), its MLP output add 2(i+1)+1; its input
        # is the stream after add 2i+1 (the embedding is add 1).
        attn_add = 2 * (layer_idx + 1)
        self.input_layernorm = beam_rms_norm(H, depth_scaled_norm_eps(eps, attn_add - 1))
        self.post_attention_layernorm = beam_rms_norm(H, eps)
        self.pre_feedforward_layernorm = beam_rms_norm(H, depth_scaled_norm_eps(eps, attn_add))
        self.post_feedforward_layernorm = beam_rms_norm(H, eps)

    def forward(self, positions: torch.Tensor, update: torch.Tensor, residual: torch.Tensor | None,
                ssmax_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`update`: the previous layer's normed MLP output (the embedding for layer 0);
        `residual`: the un-scaled residual sum g before it (None for layer 0)."""
        if residual is None:
            residual, x = update, self.input_layernorm(update)
        else:
            x, residual = self.input_layernorm(update, residual)  # residual += update; x = norm(residual)
        attn = self.post_attention_layernorm(self.self_attn(positions, x, ssmax_scale))
        x, residual = self.pre_feedforward_layernorm(attn, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


def residual_stream(update: torch.Tensor, residual: torch.Tensor | None, add_index: int) -> torch.Tensor:
    """Beam's residual stream h_k after its `add_index`-th add, from what the layers carry: the
    un-scaled sum g_{k-1} (`residual`, None before the first add) and the update not yet added
    (see `depth_scaled_norm_eps`): h_k = (update + g_{k-1}) / sqrt(k). Always a new tensor: the
    embedding becomes layer 0's residual, which the fused add+norm then updates in place."""
    if residual is None:
        return update.clone() if add_index == 1 else update / math.sqrt(add_index)
    return (update + residual) / math.sqrt(add_index)


@support_torch_compile
class BeamModel(nn.Module, EagleModelMixin):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        validate_beam_config(config)
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: BeamDecoderLayer(config, vllm_config.cache_config, vllm_config.quant_config,
                                            prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        # The final norm sees the stream after the last MLP add, 2 * num_layers + 1.
        self.norm = beam_rms_norm(config.hidden_size,
                                  depth_scaled_norm_eps(config.rms_norm_eps, 2 * config.num_hidden_layers + 1))
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank:
            h = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            h, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        # Once per step, shared by every NoPE layer; [T, 1, 1] for the layers' flat rows.
        ssmax_scale = ssmax_query_scale(positions.reshape(-1))
        # Auxiliary states for EAGLE3/DFlash drafters. vLLM numbers them as its Llama does: id 0 is
        # the embedding, id i the stream after decoder layer i - 1 (= the input of layer i), i.e.
        # transformers' `output_hidden_states[i]` (that tuple starts with the embeddings), so
        # DFlash's "output of layer j" is id j + 1. Beam's stream is the depth-scaled h_k, not the
        # un-scaled sum this model carries: after layer i's MLP add, k = 2 * (i + 1) + 1.
        aux: list[torch.Tensor] = []
        if 0 in self.aux_hidden_state_layers and get_pp_group().is_first_rank:
            aux.append(residual_stream(h, residual, 1))
        for idx in range(self.start_layer, self.end_layer):
            h, residual = self.layers[idx](positions, h, residual, ssmax_scale)
            if idx + 1 in self.aux_hidden_state_layers:
                aux.append(residual_stream(h, residual, 2 * (idx + 1) + 1))
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": h, "residual": residual})
        h, _ = self.norm(h, residual)
        return (h, aux) if aux else h


class BeamForCausalLM(nn.Module, SupportsPP, SupportsEagle3):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    # checkpoint name part -> (vLLM parameter name part, shard id). Dense MLP and attention both
    # have a `gate_proj`: only the MLP's is stacked, so the MLP rules carry their `mlp.` prefix.
    stacked_params_mapping = [
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".mlp.gate_up_proj.", ".mlp.gate_proj.", 0),
        (".mlp.gate_up_proj.", ".mlp.up_proj.", 1),
    ]

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.model = BeamModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=self.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))
        else:
            self.lm_head = PPMissingLayer()
        # The soft-cap is applied in compute_logits, in fp32 (bf16 tanh quantises badly near +-c).
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.soft_cap = config.final_logit_softcapping
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:
        """The final hidden states; with auxiliary layers set (`set_aux_hidden_state_layers`, done by
        vLLM's runner for EAGLE3/DFlash drafters) also the list of those layers' states, in id order."""
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        """vLLM's rule (2, n // 2, n - 3) where it names three distinct layers (n >= 8; Beam-501B:
        2, 26, 49); shallower models get (1, n // 2 + 1, n - 1) instead, where the rule collapses
        (n = 5 gives 2, 2, 2). A drafter's config.json naming its layers takes precedence."""
        n = self.config.num_hidden_layers
        layers = (2, n // 2, n - 3)
        return layers if len(set(layers)) == 3 and layers[0] < layers[1] < layers[2] else (1, n // 2 + 1, n - 1)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(self.lm_head, hidden_states)
        if logits is not None and self.soft_cap:
            logits = torch.tanh(logits.float() / self.soft_cap) * self.soft_cap
        return logits

    def get_expert_mapping(self) -> list[tuple[str, str, int, str]]:
        # (param part, checkpoint part, expert id, shard), e.g.
        # ("experts.routed_experts.w13_", "experts.5.gate_proj.", 5, "w1").
        return fused_moe_make_expert_params_mapping(
            self, ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
            ckpt_up_proj_name="up_proj", num_experts=self.config.num_experts,
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load published tensors by name. Returns the vLLM parameter names that were filled.

        Under expert parallelism a rank skips experts it does not hold (RoutedExperts' loader
        returns False for them); every other tensor the checkpoint names must exist here.
        """
        params = dict(self.named_parameters())
        expert_mapping = self.get_expert_mapping()
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._load_one(name, tensor, params, expert_mapping)
            if target is not None:
                loaded.add(target)
        return loaded

    def _load_one(self, name, tensor, params, expert_mapping) -> str | None:
        if ".mlp.experts." in name:
            for param_part, ckpt_part, expert_id, shard in expert_mapping:
                if ckpt_part not in name:
                    continue
                target = name.replace(ckpt_part, param_part)
                if is_pp_missing_parameter(target, self):
                    return None
                param = self._param(params, target, name)
                ok = param.weight_loader(param, tensor, target, shard_id=shard, expert_id=expert_id,
                                         return_success=True)
                return target if ok else None
            raise KeyError(f"Beam: checkpoint tensor {name!r} looks like an expert weight but matches no "
                           f"expert of this model (num_experts={self.config.num_experts})")
        for param_part, ckpt_part, shard in self.stacked_params_mapping:
            if ckpt_part in name:
                target = name.replace(ckpt_part, param_part)
                if is_pp_missing_parameter(target, self):
                    return None
                param = self._param(params, target, name)
                param.weight_loader(param, tensor, shard)
                return target
        # The checkpoint's per-head `gate_bias` lives in the gate linear's bias here; FP8 KV-cache
        # scales (compressed-tensors puts them on the attention module: `beam-hpu calibrate-kv`)
        # on vLLM's Attention layer, whose KV-cache method created them.
        name_in_model = KV_CACHE_SCALE.sub(r".self_attn.attn.\1_scale", name)
        name_in_model = name_in_model.replace(".self_attn.gate_bias", ".self_attn.gate_proj.bias")
        if is_pp_missing_parameter(name_in_model, self):
            return None
        param = self._param(params, name_in_model, name)
        getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        return name_in_model

    @staticmethod
    def _param(params: dict, target: str, ckpt_name: str) -> nn.Parameter:
        if target not in params:
            raise KeyError(f"Beam: checkpoint tensor {ckpt_name!r} has no parameter in the model "
                           f"(looked for {target!r})")
        return params[target]
