"""Beam's configuration: the transformers class when it exists, ours when it does not, and the
checks vLLM needs before it builds a model.

transformers >= 5.24 ships `BeamConfig` (model_type "beam"); the port image may carry an older
transformers, so `beam_config_class()` falls back to `FallbackBeamConfig`, which has the same fields
and defaults. `validate_beam_config()` is what the vLLM model calls first: every error names the
config field at fault, so a bad checkpoint fails at load, not with a shape error deep in a layer.
"""

from __future__ import annotations

from typing import Any

from beam_hpu.names import MODEL_TYPE

LAYER_KINDS = ("sliding_attention", "full_attention")
MLP_KINDS = ("dense", "sparse")


def default_layer_types(num_layers: int) -> list[str]:
    # Every sixth layer runs full attention, and so does the last one (Beam-1.0: 9 full, 43 SWA).
    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)]
    if kinds:
        kinds[-1] = "full_attention"
    return kinds


def default_mlp_layer_types(num_layers: int) -> list[str]:
    dense = min(3, num_layers)
    return ["dense"] * dense + ["sparse"] * (num_layers - dense)


def beam_config_class():
    try:
        from transformers.models.beam.configuration_beam import BeamConfig

        return BeamConfig
    except ImportError:
        return _fallback_class()


def register_config() -> None:
    """Make `model_type: beam` resolvable in this process (only where transformers lacks Beam)."""
    from transformers import AutoConfig

    try:
        AutoConfig.for_model(MODEL_TYPE)
    except ValueError:
        AutoConfig.register(MODEL_TYPE, beam_config_class(), exist_ok=True)


_FALLBACK = None


def _fallback_class():
    """A PretrainedConfig with BeamConfig's fields and defaults, for transformers without Beam."""
    global _FALLBACK
    if _FALLBACK is not None:
        return _FALLBACK
    from transformers import PretrainedConfig

    class FallbackBeamConfig(PretrainedConfig):
        model_type = MODEL_TYPE

        def __init__(
            self,
            vocab_size=151936,
            hidden_size=5120,
            intermediate_size=20480,
            num_hidden_layers=52,
            num_attention_heads=48,
            num_key_value_heads=8,
            hidden_act="silu",
            max_position_embeddings=8192,
            initializer_range=0.02,
            rms_norm_eps=1e-6,
            use_cache=True,
            tie_word_embeddings=False,
            rope_parameters=None,
            attention_bias=False,
            sliding_window=512,
            attention_dropout=0.0,
            moe_intermediate_size=2560,
            num_experts_per_tok=8,
            num_experts=256,
            norm_topk_prob=True,
            output_router_logits=False,
            head_dim=128,
            layer_types=None,
            mlp_layer_types=None,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            final_logit_softcapping=30.0,
            **kwargs,
        ):
            self.vocab_size = vocab_size
            self.hidden_size = hidden_size
            self.intermediate_size = intermediate_size
            self.num_hidden_layers = num_hidden_layers
            self.num_attention_heads = num_attention_heads
            self.num_key_value_heads = num_key_value_heads
            self.hidden_act = hidden_act
            self.max_position_embeddings = max_position_embeddings
            self.initializer_range = initializer_range
            self.rms_norm_eps = rms_norm_eps
            self.use_cache = use_cache
            self.attention_bias = attention_bias
            self.sliding_window = sliding_window
            self.attention_dropout = attention_dropout
            self.moe_intermediate_size = moe_intermediate_size
            self.num_experts_per_tok = num_experts_per_tok
            self.num_experts = num_experts
            self.norm_topk_prob = norm_topk_prob
            self.output_router_logits = output_router_logits
            self.head_dim = head_dim
            self.layer_types = layer_types or default_layer_types(num_hidden_layers)
            self.mlp_layer_types = mlp_layer_types or default_mlp_layer_types(num_hidden_layers)
            self.rope_parameters = rope_parameters or {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": None,
            }
            self.n_group = n_group
            self.topk_group = topk_group
            self.routed_scaling_factor = routed_scaling_factor
            self.final_logit_softcapping = final_logit_softcapping
            super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    _FALLBACK = FallbackBeamConfig
    return _FALLBACK


class BeamConfigError(ValueError):
    """A Beam config.json value the model cannot be built from; the message names the field."""


def _get(config: Any, name: str):
    if not hasattr(config, name):
        raise BeamConfigError(f"Beam config: required field `{name}` is missing")
    return getattr(config, name)


def validate_beam_config(config: Any) -> None:
    """Refuse a config the Beam model cannot be built from. Each message names the field."""
    n_layers = _get(config, "num_hidden_layers")
    for field, kinds in (("layer_types", LAYER_KINDS), ("mlp_layer_types", MLP_KINDS)):
        values = _get(config, field)
        if values is None or len(values) != n_layers:
            got = None if values is None else len(values)
            raise BeamConfigError(
                f"Beam config: `{field}` must list one entry per layer "
                f"(num_hidden_layers={n_layers}), got {got}"
            )
        unknown = sorted({v for v in values if v not in kinds})
        if unknown:
            raise BeamConfigError(f"Beam config: `{field}` has unknown kinds {unknown}; expected {list(kinds)}")
    if "sliding_attention" in config.layer_types and not _get(config, "sliding_window"):
        raise BeamConfigError("Beam config: `sliding_window` must be a positive int when "
                              "`layer_types` has sliding_attention layers")
    heads, kv_heads = _get(config, "num_attention_heads"), _get(config, "num_key_value_heads")
    if kv_heads <= 0 or heads % kv_heads:
        raise BeamConfigError(
            f"Beam config: `num_attention_heads` ({heads}) must be divisible by "
            f"`num_key_value_heads` ({kv_heads})"
        )
    experts, groups = _get(config, "num_experts"), _get(config, "n_group")
    topk_group, top_k = _get(config, "topk_group"), _get(config, "num_experts_per_tok")
    if "sparse" in config.mlp_layer_types:
        if not groups or groups <= 0 or experts % groups:
            raise BeamConfigError(
                f"Beam config: `num_experts` ({experts}) must be divisible by `n_group` ({groups})"
            )
        if not topk_group or not 0 < topk_group <= groups:
            raise BeamConfigError(
                f"Beam config: `topk_group` ({topk_group}) must be between 1 and `n_group` ({groups})"
            )
        if experts // groups < 2:
            raise BeamConfigError(
                f"Beam config: each expert group needs >= 2 experts (group score = sum of its top 2); "
                f"`num_experts`/`n_group` = {experts}/{groups}"
            )
        if not 0 < top_k <= topk_group * (experts // groups):
            raise BeamConfigError(
                f"Beam config: `num_experts_per_tok` ({top_k}) must be between 1 and the experts in "
                f"`topk_group` groups ({topk_group * (experts // groups)})"
            )
    rope = _get(config, "rope_parameters")
    for kind in set(config.layer_types):
        if not isinstance(rope, dict) or kind not in rope:
            raise BeamConfigError(f"Beam config: `rope_parameters` must have an entry for `{kind}`")
    if rope.get("full_attention") is not None:
        raise BeamConfigError("Beam config: `rope_parameters.full_attention` must be null "
                              "(full-attention layers are NoPE with SSMax query scaling)")
    sliding_rope = rope.get("sliding_attention")
    if "sliding_attention" in config.layer_types and (
        not sliding_rope or sliding_rope.get("rope_type", "default") != "default"
    ):
        raise BeamConfigError("Beam config: `rope_parameters.sliding_attention` must be a default "
                              f"RoPE entry with `rope_theta`, got {sliding_rope!r}")
