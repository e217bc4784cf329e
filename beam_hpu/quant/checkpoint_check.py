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
- with `require_portable_scheme` (CPU, where `beam_hpu.quant.portable_fp8_moe` serves experts):
  every config group is the published scheme: FP8 channel-symmetric static weights, dynamic
  per-token FP8 activations. On HPU vllm-gaudi's compressed-tensors methods decide which schemes
  they run, so the scheme check is left to them.

`install()` (from `beam_hpu.register()`) runs the check at the start of `BaseModelLoader.load_model`
(before the model is built) for Beam checkpoints with a compressed-tensors config. The default and
safetensors loaders use that method; a loader that overrides `load_model` (tensorizer) skips it.
"""

from __future__ import annotations

import json
from pathlib import Path

PUBLISHED_SCHEME = ("weights: float 8-bit, strategy channel, symmetric, static; "
                    "input_activations: float 8-bit, strategy token, dynamic (compressed-tensors FP8_DYNAMIC)")
FP8_DTYPE, SCALE_DTYPE = "F8_E4M3", "F32"
_installed = False


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
    """name -> (safetensors dtype, shape) for every tensor of every shard, from headers only."""
    headers = {}
    for shard in sorted(checkpoint_dir.glob("*.safetensors")):
        with open(shard, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        headers.update({name: (info["dtype"], info["shape"]) for name, info in header.items()})
    return headers


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


def _checkpoint_dir(model_config) -> Path | None:
    path = Path(model_config.model)
    if path.is_dir():
        return path
    try:  # a hub id: its files, if vLLM (or anyone) already put them in the local cache
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_config.model, revision=model_config.revision, local_files_only=True))
    except Exception:
        return None


def check_before_load(model_config) -> None:
    """The check for the model vLLM is about to build, if it is a compressed-tensors Beam."""
    from vllm.platforms import current_platform

    from beam_hpu import ARCH, logger

    if ARCH not in (getattr(model_config.hf_config, "architectures", None) or []):
        return
    if model_config.quantization != "compressed-tensors":
        return
    checkpoint_dir = _checkpoint_dir(model_config)
    if checkpoint_dir is None:
        logger.warning("beam_hpu: FP8 checkpoint check skipped: %s is neither a directory nor in the local "
                       "hub cache", model_config.model)
        return
    # CPU runs FP8 experts on the portable path, which serves the published scheme only.
    check_fp8_checkpoint(checkpoint_dir, require_portable_scheme=current_platform.is_cpu())


def install() -> None:
    """Run `check_before_load` at the start of every vLLM loader's `load_model`. Idempotent."""
    global _installed
    if _installed:
        return
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    stock_load_model = BaseModelLoader.load_model

    def load_model(self, vllm_config, model_config, *args, **kwargs):
        check_before_load(model_config)
        return stock_load_model(self, vllm_config, model_config, *args, **kwargs)

    load_model.__wrapped__ = stock_load_model
    BaseModelLoader.load_model = load_model
    _installed = True
