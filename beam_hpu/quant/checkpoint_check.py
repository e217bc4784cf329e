"""Refuse a compressed-tensors FP8 Beam checkpoint that does not hold what its config promises,
before vLLM builds the model, naming the tensor or the scheme.

Why here: vLLM 0.30.0 checks that every parameter was loaded only for *unquantised* models
(DefaultModelLoader.track_weights_loading); for a quantised one a missing `weight_scale` leaves
the scale parameter as uninitialised memory and the model serves garbage. A scale of the wrong
shape fails deep in a weight loader without the tensor's name, and a scheme the CPU build cannot
run surfaces as `Unsupported FP8 MoE backend: NONE`. This check reads only config.json and the
safetensors headers (no tensor data), so it is cheap enough for every worker.

What is checked (`check_fp8_checkpoint`):
- every Linear weight the quantization_config targets (same matching as the quantiser:
  compressed-tensors' `match_quantizable_tensors`) is FP8 e4m3 and has an fp32 `weight_scale`
  of shape [out, 1]; no `weight_scale` belongs to an untargeted module; no `input_scale`
  (activations are dynamic);
- with `require_portable_scheme` (CPU, where `beam_hpu.runtime.fp8.portable_moe` serves experts):
  every config group is the published scheme: FP8 channel-symmetric static weights, dynamic
  per-token FP8 activations. On HPU vllm-gaudi's compressed-tensors methods decide which schemes
  they run, so the scheme check is left to them.

The runtime patch `fp8-checkpoint-check` (beam_hpu/patches) runs `check_before_load` at the start of `BaseModelLoader.load_model`
(before the model is built) for Beam checkpoints with a compressed-tensors config. The default and
safetensors loaders use that method; a loader that overrides `load_model` (tensorizer) skips it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from beam_hpu.loader.checkpoint import DTYPE_NAMES, open_checkpoint
from beam_hpu.location import local_checkpoint_dir
from beam_hpu.names import ARCH, LOGGER

PUBLISHED_SCHEME = ("weights: float 8-bit, strategy channel, symmetric, static; "
                    "input_activations: float 8-bit, strategy token, dynamic (compressed-tensors FP8_DYNAMIC)")
FP8_DTYPE, SCALE_DTYPE = "F8_E4M3", "F32"
logger = logging.getLogger(LOGGER)


def describe_scheme(scheme) -> str:
    def part(args):
        if args is None:
            return "none"
        kind = "dynamic" if args.dynamic else "static"
        return (f"{args.type} {args.num_bits}-bit, strategy {args.strategy}, "
                f"{'symmetric' if args.symmetric else 'asymmetric'}, {kind}")

    return f"weights: {part(scheme.weights)}; input_activations: {part(scheme.input_activations)}"


def scheme_problem(scheme) -> str | None:
    """Why `scheme` (a compressed-tensors QuantizationScheme) is not the published one, or None."""
    from compressed_tensors.quantization import QuantizationStrategy, QuantizationType

    w, a = scheme.weights, scheme.input_activations
    if w is None or (w.type, w.num_bits, w.strategy, w.symmetric, w.dynamic) != (
            QuantizationType.FLOAT, 8, QuantizationStrategy.CHANNEL, True, False):
        return "weights must be FP8 (float, 8 bits) with one static symmetric scale per output channel"
    if a is None or (a.type, a.num_bits, a.strategy, a.dynamic) != (
            QuantizationType.FLOAT, 8, QuantizationStrategy.TOKEN, True):
        return "input activations must be FP8 (float, 8 bits), quantised dynamically per token"
    return None


def tensor_headers(checkpoint_dir: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape) for every tensor, from the loader's checked headers only."""
    return {e.name: (DTYPE_NAMES[e.dtype], list(e.shape)) for e in open_checkpoint(checkpoint_dir).tensors.values()}


def check_fp8_checkpoint(checkpoint_dir: str | Path, *, require_portable_scheme: bool = True) -> None:
    """Raise ValueError naming the first tensor (or config group) that breaks the FP8 format."""
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_quantizable_tensors

    checkpoint_dir = Path(checkpoint_dir)
    raw = json.loads((checkpoint_dir / "config.json").read_text()).get("quantization_config")
    if raw is None:
        return
    where = f"{checkpoint_dir}/config.json quantization_config"
    qconfig = QuantizationConfig.model_validate(raw)
    if require_portable_scheme:
        for group, scheme in qconfig.config_groups.items():
            problem = scheme_problem(scheme)
            if problem:
                raise ValueError(f"{where}: config group {group!r} has an unsupported quantisation scheme "
                                 f"({describe_scheme(scheme)}): {problem}. Supported: {PUBLISHED_SCHEME}")
    headers = tensor_headers(checkpoint_dir)
    targeted = set()
    for scheme in qconfig.config_groups.values():
        for module, name in match_quantizable_tensors(headers, ignore=qconfig.ignore, targets=scheme.targets):
            targeted.add(module)
            dtype, shape = headers[name]
            if dtype != FP8_DTYPE or len(shape) != 2:
                raise ValueError(f"{checkpoint_dir}: {name} is targeted by the quantization_config but is "
                                 f"{dtype} {shape}, not a 2-D FP8 ({FP8_DTYPE}) weight")
            scale_name = f"{module}.weight_scale"
            if scale_name not in headers:
                raise ValueError(f"{checkpoint_dir}: {scale_name} is missing (FP8 weight {name} needs its "
                                 f"per-channel scale)")
            scale_dtype, scale_shape = headers[scale_name]
            if scale_dtype != SCALE_DTYPE or scale_shape != [shape[0], 1]:
                raise ValueError(f"{checkpoint_dir}: {scale_name} is {scale_dtype} {scale_shape}; expected "
                                 f"{SCALE_DTYPE} {[shape[0], 1]} (one scale per output channel of {name})")
    for name in sorted(headers):
        module, _, param = name.rpartition(".")
        if param == "weight_scale" and module not in targeted:
            raise ValueError(f"{checkpoint_dir}: {name} belongs to a module the quantization_config does not "
                             "target (or ignores)")
        if param == "input_scale":
            raise ValueError(f"{checkpoint_dir}: {name}: static activation scales are not supported; the "
                             "published scheme quantises activations dynamically per token")


def check_before_load(model_config) -> None:
    """The check for the model vLLM is about to build, if it is a compressed-tensors Beam."""
    from vllm.platforms import current_platform


    if ARCH not in (getattr(model_config.hf_config, "architectures", None) or []):
        return
    if model_config.quantization != "compressed-tensors":
        return
    checkpoint_dir = local_checkpoint_dir(model_config.model, model_config.revision)
    if checkpoint_dir is None:
        logger.warning("beam_hpu: FP8 checkpoint check skipped: %s is neither a directory nor in the local "
                       "hub cache", model_config.model)
        return
    # CPU runs FP8 experts on the portable path, which serves the published scheme only.
    check_fp8_checkpoint(checkpoint_dir, require_portable_scheme=current_platform.is_cpu())
