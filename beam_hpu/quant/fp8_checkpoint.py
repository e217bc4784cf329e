"""Write Beam checkpoints quantised the way the published FP8 checkpoint is.

The format is compressed-tensors `float-quantized`, scheme FP8_DYNAMIC: every targeted Linear
stores an FP8 e4m3 `weight` and an fp32 `weight_scale [out, 1]` (symmetric, one scale per output
channel); activations are quantised per token at run time, so there is no `input_scale`. Each
expert projection is its own Linear in the published layout and is quantised like any other.
The router (`mlp.gate`, fp32), the LM head and the embeddings stay unquantised; norms, attention
gate biases and the routing correction bias are not Linear weights, so they are never targets.

The conversion runs through compressed-tensors' own checkpoint converter (`convert_checkpoint`
with a `Converter`), so names, the config block in `config.json`, the safetensors index and the
copied tokenizer files are the library's, not ours.
"""

from __future__ import annotations

from pathlib import Path

# Module names (regex with "re:") left unquantised. The router must stay out because vLLM builds
# it as an fp32 GateLinear with no quant method, and `re:.*mlp[.]gate$` does not touch
# `mlp.gate_proj` (dense MLP) or `self_attn.gate_proj` (attention output gate, quantised).
# `model.embed_tokens` is listed because checkpoint-level matching cannot see module classes.
BEAM_FP8_IGNORE = ["lm_head", "model.embed_tokens", "re:.*mlp[.]gate$"]
FORMAT = "float-quantized"


def beam_fp8_quantization_config(ignore: list[str] | None = None):
    """The compressed-tensors QuantizationConfig of the published checkpoint (FP8_DYNAMIC)."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

    scheme = preset_name_to_scheme("FP8_DYNAMIC", targets=["Linear"])
    scheme.format = FORMAT
    return QuantizationConfig(
        config_groups={"group_0": scheme},
        format=FORMAT,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=list(BEAM_FP8_IGNORE if ignore is None else ignore),
    )


class BeamFp8Quantizer:
    """A compressed-tensors `Converter`: unquantised Beam tensors -> FP8 weights + channel scales.

    Implements the library's Converter protocol (process / validate / create_config /
    get_dependencies) so `compressed_tensors.entrypoints.convert.convert_checkpoint` drives it.
    """

    def __init__(self, ignore: list[str] | None = None):
        self.config = beam_fp8_quantization_config(ignore)
        (self.scheme,) = self.config.config_groups.values()

    def _targets(self, tensors):
        from compressed_tensors.utils.match import match_quantizable_tensors

        return list(match_quantizable_tensors(tensors, ignore=self.config.ignore, targets=self.scheme.targets))

    def validate(self, tensors) -> None:
        for _, name in self._targets(tensors):
            t = tensors[name]
            if t.ndim != 2 or not t.is_floating_point() or t.dtype == self.scheme.weights.pytorch_dtype():
                raise ValueError(f"{name}: expected an unquantised 2-D Linear weight, got {t.dtype} {tuple(t.shape)}")

    def process(self, tensors):
        from compressed_tensors.compressors import FloatQuantizationCompressor
        from compressed_tensors.quantization.utils import calculate_qparams

        out = dict(tensors)
        for module, name in self._targets(tensors):
            # Scales from the fp32 weight, so `weight_scale` is fp32 whatever the source dtype.
            w = out.pop(name).float()
            scale, zero_point = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True),
                                                  self.scheme.weights)
            packed = FloatQuantizationCompressor.compress(
                {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}, self.scheme)
            out.update({f"{module}.{param}": t.contiguous() for param, t in packed.items()})
        return out

    def create_config(self):
        return self.config

    def get_dependencies(self, weight_name: str) -> set[str]:
        return set()  # each weight is quantised on its own (channel scales need nothing else)


def load_checkpoint_tensors(checkpoint_dir: str | Path) -> dict:
    """Every tensor of every safetensors shard in `checkpoint_dir`, by name (small checkpoints)."""
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def quantize_checkpoint(src: str | Path, out: str | Path, ignore: list[str] | None = None) -> Path:
    """Write an FP8 copy of the unquantised checkpoint `src` into `out` (other files copied)."""
    from compressed_tensors.entrypoints.convert import convert_checkpoint

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    convert_checkpoint(str(src), str(out), BeamFp8Quantizer(ignore))
    return out


def dequantize_checkpoint(src: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write the weight-only copy of the FP8 checkpoint `src`: every FP8 weight replaced by
    `fp8 * weight_scale` in `dtype`, no quantization_config. Served, it is the FP8 model with the
    activation quantisation removed (what a dequantise-everything upcast path would compute).
    compressed-tensors' own dequantiser does the arithmetic, as in `beam_hpu.reference.in_memory`."""
    import json
    import shutil

    import torch
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer

    from beam_hpu.loader.checkpoint import write_shards

    src, out = Path(src), Path(out)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tensors = load_checkpoint_tensors(src)
    dequantizer = CompressedTensorsDequantizer(str(src), dtype=torch_dtype)
    dequantizer.validate(tensors)
    state = dequantizer.process(tensors)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    cfg["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    # Everything in `dtype` except the router (`mlp.gate.*`), which the published layout keeps fp32.
    state = {n: t if ".mlp.gate." in n or not t.is_floating_point() else t.to(torch_dtype) for n, t in state.items()}
    write_shards(state, out, num_shards=len(list(src.glob("*.safetensors"))))
    return out
