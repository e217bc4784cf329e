"""The per-token FP8 reference for Beam, and the unquantised oracle, on transformers' Beam model.

"The per-token FP8 CPU reference" of the recipe is transformers' `BeamForCausalLM` with
- weights dequantised from the checkpoint (`fp8 * weight_scale`, held in fp32), and
- the input of every quantised linear rounded to FP8 e4m3 per token (one absmax scale per row,
  mapped to +-`fp8_max`) before an fp32 matmul: exactly what a W8A8 kernel with fp32 accumulate
  computes, so the only roundings left are the FP8 ones the checkpoint implies.
`fp8_max` is 448 for OCP e4m3fn (CPU, CUDA) and 240 for Gaudi 2's e4m3. `exact` picks the
rounding (beam_hpu.quant.rounding): the reference's own (x / scale, the default) or the device's
fast path (x * (1 / scale) after a scale of (amax + 1e-8) / fp8_max), as BEAM_EXACT_ROUNDING does.

Where the activation rounding is inserted, and why there:
- Dense linears (attention q/k/v/o and output gate, dense MLP) are `nn.Linear` modules: a forward
  pre-hook rounds their input, so transformers' own forward code runs unchanged.
- Experts are fused 3-D parameters (`experts.gate_up_proj`, `experts.down_proj`) applied with
  `F.linear` inside `BeamExperts.forward`, where no module hook can reach the matmul input.
  transformers dispatches that forward through its experts-implementation registry
  (`ExpertsInterface`, chosen by `config._experts_implementation`), so the reference registers
  its own implementation there: a per-expert loop that rounds the input of both expert matmuls.

Each hooked module carries `beam_fp8_input_quant` (a function, or None for no rounding), so
`set_activation_quant(model, None)` gives the weight-only model from the same loaded weights.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from beam_hpu.quant.fp8_checkpoint import load_checkpoint_tensors
from beam_hpu.reference import kv_fp8
# fake_quant_per_token, the two FP8 ranges: re-exported, callers import them from here too.
from beam_hpu.quant.rounding import FP8_E4M3FN_MAX, GAUDI2_FP8_MAX, fake_quant_per_token  # noqa: F401

EXPERTS_IMPL = "beam_fp8_reference"
INPUT_QUANT_ATTR = "beam_fp8_input_quant"


def _round_input(x: torch.Tensor, module) -> torch.Tensor:
    quant = getattr(module, INPUT_QUANT_ATTR, None)
    return x.float() if quant is None else quant(x)


def linear_input_hook(module, args):
    return (_round_input(args[0], module).to(args[0].dtype),) + tuple(args[1:])


def fp8_reference_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """BeamExperts forward with each expert's matmul inputs rounded per token; fp32 accumulate.

    `gate_up_proj[e]` is [gate; up] stacked on the output dim (transformers' fused layout), so
    one rounding of the token serves both halves, as in a fused w13 kernel.
    """
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    for expert in top_k_index.unique().tolist():
        add_fp8_expert(self, out, expert, self.gate_up_proj[expert], self.down_proj[expert],
                       hidden_states, top_k_index, top_k_weights)
    return out.to(hidden_states.dtype)


def add_fp8_expert(experts, out, expert: int, gate_up, down, hidden_states, top_k_index, top_k_weights) -> None:
    """Add expert `expert` (weights `gate_up`, `down`), computed on the tokens routed to it, into the
    fp32 sum `out`. One function for the in-memory forward above and the layer-streaming reference
    (`beam_hpu.reference.streamed`), which holds one expert's weights at a time."""
    tokens, slots = (top_k_index == expert).nonzero(as_tuple=True)
    gate_up = F.linear(_round_input(hidden_states[tokens], experts), gate_up.float())
    act = experts._apply_gate(gate_up.to(hidden_states.dtype))
    y = F.linear(_round_input(act, experts), down.float())
    out.index_add_(0, tokens, y * top_k_weights[tokens, slots, None].float())


def _register_experts_impl() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPL, fp8_reference_experts_forward)


def quantization_config(checkpoint_dir: Path):
    from compressed_tensors.quantization import QuantizationConfig

    qc = json.loads((checkpoint_dir / "config.json").read_text()).get("quantization_config")
    return None if qc is None else QuantizationConfig.model_validate(qc)


def _dequantised_model(checkpoint_dir: Path, tensors: dict, dtype: torch.dtype):
    """transformers' Beam loaded from `checkpoint_dir` with FP8 weights replaced by fp8 * scale.

    compressed-tensors' own dequantising converter does the arithmetic (in memory: its
    `convert_checkpoint` driver, in 0.17.0, asks for a `weight_scale` of every norm);
    transformers then loads the result, fusing the per-expert tensors as for any Beam checkpoint.
    """
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer
    from transformers.models.beam import BeamConfig, BeamForCausalLM

    dequantizer = CompressedTensorsDequantizer(str(checkpoint_dir), dtype=dtype)
    dequantizer.validate(tensors)
    config_dict = json.loads((checkpoint_dir / "config.json").read_text())
    del config_dict["quantization_config"]  # the weights handed over are no longer quantised
    config = BeamConfig.from_dict(config_dict)
    return BeamForCausalLM.from_pretrained(None, config=config, state_dict=dequantizer.process(tensors),
                                           dtype=dtype, experts_implementation="eager").eval()


def quantised_modules(model, checkpoint_dir: Path, tensor_names, qconfig):
    """The HF modules whose weights the checkpoint stores in FP8: linears, and experts modules.

    Class-based matching on the model must agree with the tensors on disk; a disagreement (e.g.
    an ignore pattern that only matches one side) would make the reference silently wrong.
    """
    from compressed_tensors.utils.match import match_named_modules
    from transformers.models.beam.modeling_beam import BeamExperts

    scaled = {n.removesuffix(".weight_scale") for n in tensor_names if n.endswith(".weight_scale")}
    targets = [t for scheme in qconfig.config_groups.values() for t in scheme.targets]
    linears = dict(match_named_modules(model, targets, qconfig.ignore))
    experts = {n: m for n, m in model.named_modules() if isinstance(m, BeamExperts)}
    unscaled = sorted(set(linears) - scaled)
    if unscaled:
        raise ValueError(f"{checkpoint_dir}: {unscaled[0]} matches the quantization config but has no weight_scale")
    projections = [f"{name}.{e}.{p}" for name, m in experts.items() for e in range(m.num_experts)
                   for p in ("gate_proj", "up_proj", "down_proj")]
    unscaled = [p for p in projections if p not in scaled]
    if unscaled:
        raise ValueError(f"{checkpoint_dir}: expert projection {unscaled[0]} is not FP8; the reference "
                         "supports all-FP8 experts only")
    stray = sorted(scaled - set(linears) - set(projections))
    if stray:
        raise ValueError(f"{checkpoint_dir}: {stray[0]}.weight_scale belongs to no quantised module of the model")
    return list(linears.values()), list(experts.values())


def set_activation_quant(model, fp8_max: float | None, exact: bool = True) -> None:
    """Round the inputs of every quantised linear and expert to FP8 (`fp8_max`), or not (None);
    `exact`: the reference's rounding, or the device's fast path (beam_hpu.quant.rounding)."""
    quant = None if fp8_max is None else partial(fake_quant_per_token, fp8_max=fp8_max, exact=exact)
    for module in model.beam_fp8_modules:
        setattr(module, INPUT_QUANT_ATTR, quant)


def load_reference(checkpoint_dir: str | Path, fp8_max: float = FP8_E4M3FN_MAX, dtype: torch.dtype = torch.float32,
                   exact: bool = True, kv_scales=None):
    """The per-token FP8 reference for a compressed-tensors FP8 Beam checkpoint: FP8 weights and
    per-token FP8 activations into every quantised matmul; everything else computed in `dtype`
    (fp32 by default; bf16 to compare with a server that computes in bf16). `exact=False` rounds
    activations as the device's fast path does (BEAM_EXACT_ROUNDING=0), to compare like with like.
    `kv_scales` (beam_hpu.reference.kv_fp8.KvScales): K and V also rounded through FP8 of range
    `fp8_max` with those per-layer scales, as an FP8 KV cache holds them (`kv_fp8.set_kv_rounding`
    switches it later on the same model)."""
    checkpoint_dir = Path(checkpoint_dir)
    qconfig = quantization_config(checkpoint_dir)
    if qconfig is None:
        raise ValueError(f"{checkpoint_dir}/config.json has no quantization_config: not an FP8 checkpoint")
    tensors = load_checkpoint_tensors(checkpoint_dir)
    names = list(tensors)
    model = _dequantised_model(checkpoint_dir, tensors, dtype)
    linears, experts = quantised_modules(model, checkpoint_dir, names, qconfig)
    for linear in linears:
        linear.register_forward_pre_hook(linear_input_hook)
    _register_experts_impl()
    model.set_experts_implementation(EXPERTS_IMPL)
    model.beam_fp8_modules = linears + experts
    set_activation_quant(model, fp8_max, exact)
    kv_fp8.install(model)
    if kv_scales is not None:
        kv_fp8.check_layers(kv_scales, model.config.num_hidden_layers)
        kv_fp8.set_kv_rounding(model, kv_scales, fp8_max, exact)
    return model


def load_oracle(checkpoint_dir: str | Path, dtype: torch.dtype = torch.bfloat16):
    """transformers' Beam, unquantised activations, in `dtype` (bf16 or fp32).

    For an unquantised checkpoint this is the plain model. For an FP8 checkpoint the weights are
    dequantised (weight-only); the bf16 model a tiny FP8 checkpoint was made from is
    `beam_hpu.tiny.checkpoint.write_tiny_checkpoint` with the same preset and seed (see its beam_tiny.json).
    """
    from transformers.models.beam import BeamForCausalLM

    checkpoint_dir = Path(checkpoint_dir)
    if quantization_config(checkpoint_dir) is not None:
        return _dequantised_model(checkpoint_dir, load_checkpoint_tensors(checkpoint_dir), dtype)
    return BeamForCausalLM.from_pretrained(str(checkpoint_dir), dtype=dtype, experts_implementation="eager").eval()


@torch.no_grad()
def next_token_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] fp32 log-probabilities of the next token at every position."""
    logits = model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def prompt_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids) - 1] fp32: log p(token i | tokens < i) for i >= 1 (vLLM's prompt_logprobs)."""
    lp = next_token_logprobs(model, token_ids)[:-1]
    return lp.gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]
