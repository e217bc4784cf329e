"""The FP8 tiny checkpoint: exact tensors on disk, config, round-trip error, and vLLM's parser."""

import json
import os
import re

import pytest
import torch

from beam_hpu.quant.fp8_checkpoint import BeamFp8Quantizer, load_checkpoint_tensors

FP8 = torch.float8_e4m3fn
UNQUANTISED = re.compile(r"^(lm_head|model\.embed_tokens)\.weight$|mlp\.gate\.weight$")


def expected_quantised(name: str, t: torch.Tensor) -> bool:
    """What the published checkpoint quantises: every 2-D Linear weight but router, LM head, embeddings."""
    return name.endswith(".weight") and t.ndim == 2 and not UNQUANTISED.search(name)


def test_tensors_on_disk_are_fp8_weights_with_fp32_channel_scales(tiny_pair):
    src, fp8 = (load_checkpoint_tensors(d) for d in tiny_pair)
    quantised = {n for n, t in src.items() if expected_quantised(n, t)}
    # Every expert projection of every sparse layer is among them.
    assert sum(".mlp.experts." in n for n in quantised) == 5 * 8 * 3
    expected_names = set(src) | {n.removesuffix("weight") + "weight_scale" for n in quantised}
    assert set(fp8) == expected_names  # no input_scale (dynamic activations), nothing dropped
    for name, w in src.items():
        if name in quantised:
            # Independent statement of the scheme: symmetric absmax per output row onto e4m3fn's 448.
            scale = w.float().abs().amax(dim=1, keepdim=True) / 448.0
            q = (w.float() / scale).clamp(-448, 448).to(FP8)
            assert fp8[name].dtype == FP8 and fp8[name].shape == w.shape, name
            assert torch.equal(fp8[name].view(torch.uint8), q.view(torch.uint8)), name
            s = fp8[name.removesuffix("weight") + "weight_scale"]
            assert s.dtype == torch.float32 and s.shape == (w.shape[0], 1), name
            assert torch.equal(s, scale), name
        else:
            assert fp8[name].dtype == w.dtype and torch.equal(fp8[name], w), name
    assert fp8["model.layers.1.mlp.gate.weight"].dtype == torch.float32


def test_round_trip_error_is_within_e4m3_rounding(tiny_pair):
    src, fp8 = (load_checkpoint_tensors(d) for d in tiny_pair)
    for name, q in fp8.items():
        if q.dtype != FP8:
            continue
        w = src[name].float()
        scale = fp8[name.removesuffix("weight") + "weight_scale"]
        err = (q.float() * scale - w).abs()
        # Round-to-nearest with 3 mantissa bits: relative error <= 2^-4 on normals; below the
        # smallest normal (2^-6 * scale) the step is 2^-9 * scale.
        bound = torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
        assert (err <= bound).all(), name
        assert (err.norm() / w.norm()).item() < 0.04, name


def test_config_is_the_published_compressed_tensors_block(tiny_pair):
    src_cfg, cfg = (json.loads((d / "config.json").read_text()) for d in tiny_pair)
    qc = cfg.pop("quantization_config")
    assert cfg == src_cfg  # the model config itself is unchanged
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == "float-quantized" and qc["quantization_status"] == "compressed"
    assert qc["ignore"] == ["lm_head", "model.embed_tokens", "re:.*mlp[.]gate$"]
    assert qc["kv_cache_scheme"] is None
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["output_activations"] is None
    w, a = group["weights"], group["input_activations"]
    assert (w["type"], w["num_bits"], w["strategy"], w["symmetric"], w["dynamic"]) == ("float", 8, "channel", True, False)
    assert (a["type"], a["num_bits"], a["strategy"], a["symmetric"], a["dynamic"]) == ("float", 8, "token", True, True)


def test_index_and_side_files(tiny_pair):
    src, fp8 = tiny_pair
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(load_checkpoint_tensors(fp8))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (fp8 / f).read_bytes() == (src / f).read_bytes(), f


def test_quantizer_refuses_an_already_fp8_weight():
    tensors = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4, dtype=FP8)}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight"):
        BeamFp8Quantizer().validate(tensors)


def test_vllm_parses_the_config_as_w8a8_fp8_channel_weights_dynamic_token_activations(tiny_pair):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsW8A8Fp8
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8DynamicTokenSym, kFp8StaticChannelSym

    fp8 = tiny_pair[1]
    model_config = ModelConfig(model=str(fp8), dtype="bfloat16", max_model_len=256)
    assert model_config.quantization == "compressed-tensors"
    qc = CompressedTensorsConfig.from_config(json.loads((fp8 / "config.json").read_text())["quantization_config"])
    linear = torch.nn.Linear(2, 2)
    with set_current_vllm_config(VllmConfig(model_config=model_config)):
        for name in ("model.layers.0.self_attn.q_proj", "model.layers.2.self_attn.gate_proj", "model.layers.0.mlp.down_proj"):
            scheme = qc.get_scheme(linear, name)
            assert isinstance(scheme, CompressedTensorsW8A8Fp8), name
            assert scheme.weight_quant_key == kFp8StaticChannelSym and scheme.activation_quant_key == kFp8DynamicTokenSym
        # The MoE method is picked from the scheme of expert 0's projections.
        expert = qc.get_scheme_dict(linear, "model.layers.1.mlp.experts.0.gate_proj")
        assert (expert["weights"].strategy, expert["input_activations"].strategy) == ("channel", "token")
        assert expert["input_activations"].dynamic is True
        for name in ("model.layers.1.mlp.gate", "lm_head", "model.embed_tokens"):
            assert qc.get_scheme(linear, name) is None, name
