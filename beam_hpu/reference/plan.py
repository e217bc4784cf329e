"""What a streamed reference run computes, checked before it reads a weight: the passages (ids in
the vocabulary, lengths, scored flags), the streams, transformers' Beam built on the meta device
(no memory) per dtype with the in-memory reference's FP8 hooks, and every tensor each layer needs
present in the checkpoint's header table with the shape the model needs. A bad input is an error
here, naming the passage, file or tensor, before the long work starts."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from beam_hpu.loader.checkpoint import CheckpointError, open_checkpoint
from beam_hpu.reference import kv_fp8
from beam_hpu.reference import layer_stream as ls
from beam_hpu.reference.file_format import check_scored
from beam_hpu.reference.in_memory import FP8_E4M3FN_MAX, linear_input_hook, quantised_modules

logger = logging.getLogger("vllm.beam_hpu.reference")
# The stream that is the reference without FP8 KV rounding (only in a run with KV scales).
WITHOUT_KV_FP8 = "without-kv-fp8"


@dataclass
class Passage:
    name: str
    ids: list[int]
    scored: list[bool] | None = None


def read_passages(path: str | Path) -> list[Passage]:
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the passages ({e})") from None
    if not isinstance(obj, dict) or not obj:
        raise ValueError(f"{path}: expected a JSON object mapping passage names to token ids")
    out = []
    for name, value in obj.items():
        ids, scored = (value.get("token_ids"), value.get("scored")) if isinstance(value, dict) else (value, None)
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{path}: passage {name!r}: token ids must be a list of integers")
        out.append(Passage(name, ids, scored))
    return out


def text_passages(checkpoint: str | Path, files: list[str]) -> list[Passage]:
    """One passage per text file, named by its stem, tokenized with the checkpoint's tokenizer
    without special tokens (natural text, scored at every position)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    return [Passage(Path(f).stem, tok(Path(f).read_text(), add_special_tokens=False).input_ids) for f in files]


@dataclass
class Plan:
    """Everything checked before the long work starts."""

    checkpoint: object  # loader.checkpoint.Checkpoint
    config: object  # BeamConfig (of the skeletons)
    fp8: bool
    streams: list[ls.Stream]
    skeletons: dict  # dtype -> BeamForCausalLM on the meta device
    passages: list[Passage]
    dequantizer: object | None
    exact: bool = True  # the FP8 activation rounding (beam_hpu.quant.rounding), BEAM_EXACT_ROUNDING
    kv_scales: object | None = None  # kv_fp8.KvScales: the reference stream's K and V rounded through FP8
    description: dict = field(default_factory=dict)
    _layer_names: dict = field(default_factory=dict)  # layer -> its tensors on disk, experts excluded

    def layer_entries(self, i: int):
        return [self.checkpoint.tensors[n] for n in self._layer_names[i]]

    def expert_entries(self, i: int, e: int):
        return [self.checkpoint.tensors[n] for n in self._expert_names(i, e)]

    def _expert_names(self, i: int, e: int) -> list[str]:
        p = f"model.layers.{i}.mlp.experts.{e}"
        suffixes = ("weight", "weight_scale") if self.fp8 else ("weight",)
        return [f"{p}.{proj}.{s}" for proj in ls.EXPERT_PROJECTIONS for s in suffixes]

    def is_moe(self, i: int) -> bool:
        return self.config.mlp_layer_types[i] == "sparse"


def _skeleton(config_dict: dict, dtype: torch.dtype):
    from transformers.models.beam import BeamConfig, BeamForCausalLM

    config = BeamConfig.from_dict({k: v for k, v in config_dict.items() if k != "quantization_config"})
    with torch.device("meta"):
        model = BeamForCausalLM._from_config(config, dtype=dtype).eval()
    kv_fp8.install(model)  # rounds nothing until a stream with kv_fp8 sets its scales
    return model


def make_plan(checkpoint_dir: str | Path, passages: list[Passage], dtype: torch.dtype = torch.bfloat16,
              fp8_max: float | None = None, exact: bool | None = None, kv_scales=None) -> Plan:
    """`exact`: the FP8 activation rounding; None = BEAM_EXACT_ROUNDING as set here (the server's
    setting, as the live reference of the perplexity gate reads it). `kv_scales` (kv_fp8.KvScales):
    the reference stream also rounds K and V through FP8 of the activations' range with them, and a
    third stream, the same reference without that rounding, measures what the rounding costs."""
    from beam_hpu.reference.in_memory import quantization_config

    checkpoint_dir = Path(checkpoint_dir)
    try:
        config_dict = json.loads((checkpoint_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{checkpoint_dir}/config.json: {e}") from None
    qconfig = quantization_config(checkpoint_dir)
    fp8 = qconfig is not None
    if fp8_max is not None and not fp8:
        raise ValueError(f"--fp8-max {fp8_max:g}: {checkpoint_dir}/config.json has no quantization_config, "
                         f"so there is nothing to round to FP8; leave --fp8-max out for an unquantised checkpoint")
    if kv_scales is not None and not fp8:
        raise ValueError(f"--kv-scales: {checkpoint_dir}/config.json has no quantization_config; the FP8 KV "
                         f"reference is the per-token FP8 reference with its K and V rounded, for FP8 checkpoints")
    ckpt = open_checkpoint(checkpoint_dir)
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    if fp8:
        streams = [ls.Stream("reference", dtype, fp8_max or FP8_E4M3FN_MAX, True, kv_scales is not None),
                   ls.Stream("floor", dtype, None, False)]
        if kv_scales is not None:
            streams.append(ls.Stream(WITHOUT_KV_FP8, dtype, fp8_max or FP8_E4M3FN_MAX, True))
    else:
        streams = [ls.Stream("reference", dtype, None, False), ls.Stream("floor", other, None, False)]
    skeletons = {s.dtype: _skeleton(config_dict, s.dtype) for s in streams}
    config = next(iter(skeletons.values())).config
    if exact is None:
        from beam_hpu.settings import switches

        exact = bool(switches.current("BEAM_EXACT_ROUNDING"))
    plan = Plan(ckpt, config, fp8, streams, skeletons, passages, None, exact=exact, kv_scales=kv_scales)
    _check_passages(passages, config)
    if kv_scales is not None:
        kv_fp8.check_layers(kv_scales, config.num_hidden_layers)
    _check_tensors(plan, checkpoint_dir, qconfig)
    if fp8:
        from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer

        plan.dequantizer = CompressedTensorsDequantizer(str(checkpoint_dir), dtype=dtype)
    plan.description = {
        "checkpoint": str(ckpt.directory), "config": config_dict,
        "tensors": sorted((e.name, str(e.dtype), list(e.shape), Path(e.file).name, e.offset)
                          for e in ckpt.tensors.values()),
        "passages": [[p.name, p.ids, p.scored] for p in passages],
        "streams": [[s.name, str(s.dtype), s.fp8_max, s.fp8_experts] + ([True] if s.kv_fp8 else []) for s in streams],
        "exact_rounding": exact,
    }
    if kv_scales is not None:  # absent otherwise: runs begun before FP8 KV existed keep their fingerprint
        plan.description["kv_scales"] = kv_scales.describe()
    return plan


def _check_passages(passages: list[Passage], config) -> None:
    names = [p.name for p in passages]
    if len(set(names)) != len(names):
        raise ValueError("two passages have the same name")
    for p in passages:
        if len(p.ids) < 2:
            raise ValueError(f"passage {p.name!r}: {len(p.ids)} tokens; at least 2 are needed to score one")
        if len(p.ids) > config.max_position_embeddings:
            raise ValueError(f"passage {p.name!r}: {len(p.ids)} tokens, more than the model's "
                             f"max_position_embeddings {config.max_position_embeddings}")
        bad = [(i, t) for i, t in enumerate(p.ids) if not 0 <= t < config.vocab_size]
        if bad:
            raise ValueError(f"passage {p.name!r}: token id {bad[0][1]} at position {bad[0][0]} is outside the "
                             f"vocabulary (vocab_size {config.vocab_size})")
        if p.scored is not None:
            check_scored(p.name, p.ids, p.scored)


def _check_tensors(plan: Plan, checkpoint_dir: Path, qconfig) -> None:
    """Every tensor the model needs is in the header table with the shape it needs; the FP8
    config agrees with the tensors (`beam_hpu.reference.in_memory.quantised_modules`)."""
    model = next(iter(plan.skeletons.values()))
    tensors = plan.checkpoint.tensors
    needed: dict[str, tuple] = {}
    cfg = plan.config
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if ".mlp.experts." in name or name.startswith("model.rotary_emb."):
            continue
        needed[name] = tuple(t.shape)
    if cfg.tie_word_embeddings:
        needed.pop("lm_head.weight", None)
    for i, layer in enumerate(model.model.layers):
        plan._layer_names[i] = ls.layer_tensor_names(layer, f"model.layers.{i}.")
        if plan.is_moe(i):
            h, inter = cfg.hidden_size, cfg.moe_intermediate_size
            for e in range(cfg.num_experts):
                p = f"model.layers.{i}.mlp.experts.{e}"
                needed.update({f"{p}.gate_proj.weight": (inter, h), f"{p}.up_proj.weight": (inter, h),
                               f"{p}.down_proj.weight": (h, inter)})
    if plan.fp8:
        linears, experts = quantised_modules(model, checkpoint_dir, list(tensors), qconfig)
        for m in linears:
            m.register_forward_pre_hook(linear_input_hook)
        scales = [n for n in tensors if n.endswith(".weight_scale")]
        for n in scales:
            needed[n] = (needed[n.removesuffix("_scale")][0], 1)
        if "lm_head.weight_scale" in tensors:
            raise CheckpointError(f"{checkpoint_dir}: lm_head is FP8; the reference reads an unquantised LM head "
                                  f"(the published checkpoint's, compressed-tensors ignore list)")
        # Both FP8 streams compute in one dtype, so `model` is the only skeleton to hook.
        model.beam_fp8_modules = linears + experts
        for i in plan._layer_names:
            plan._layer_names[i] += [n for n in scales if n.startswith(f"model.layers.{i}.")
                                     and ".mlp.experts." not in n]
    missing = [n for n in needed if n not in tensors]
    if missing:
        layer = missing[0].split(".")[2] if missing[0].startswith("model.layers.") else None
        where = f" (layer {layer})" if layer is not None else ""
        raise CheckpointError(f"{checkpoint_dir}: tensor {missing[0]!r}{where} is missing from every shard "
                              f"({len(missing)} tensors missing)")
    for n, shape in needed.items():
        if tuple(tensors[n].shape) != shape:
            raise CheckpointError(f"{tensors[n].file}: tensor {n!r} has shape {list(tensors[n].shape)}, "
                                  f"the model needs {list(shape)}")
    stray = sorted(set(tensors) - set(needed))
    if stray:
        logger.warning("%s: %d tensors belong to no part of the model and are not read, e.g. %s",
                       checkpoint_dir, len(stray), stray[0])
