"""The streamed reference's FP8 dequantisation is compressed-tensors' own, bit for bit."""

import json

import pytest
import torch

from beam_hpu.quant.fp8_checkpoint import beam_fp8_quantization_config
from beam_hpu.quant.fp8_dequant import dequantise_rows

FP8 = torch.float8_e4m3fn
P = "model.layers.3.mlp.experts.7"


def _dequantiser(tmp_path, dtype):
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer

    qc = beam_fp8_quantization_config().model_dump(mode="json")
    qc["quant_method"] = "compressed-tensors"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "beam", "quantization_config": qc}))
    return CompressedTensorsDequantizer(str(tmp_path), dtype=dtype)


def _expert(shapes, scale_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    raw = {}
    for proj, shape in shapes.items():
        w = (torch.randn(shape, generator=g) * 16).clamp(-448, 448).to(FP8)
        codes = w.view(torch.uint8).reshape(-1)
        if len(codes) >= 513:  # every code, at even and odd places
            codes[:256] = torch.arange(256, dtype=torch.uint8)
            codes[257:513] = torch.arange(256, dtype=torch.uint8)
        raw[f"{P}.{proj}.weight"] = w
        raw[f"{P}.{proj}.weight_scale"] = (torch.rand((shape[0], 1), generator=g) * 0.01 + 1e-4).to(scale_dtype)
    return raw


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    # NaN codes (0x7f, 0xff) give NaN either way; equal bits everywhere else
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    keep = ~torch.isnan(a)
    assert torch.equal(a[keep], b[keep])


@pytest.mark.parametrize("scale_dtype,dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                               (torch.bfloat16, torch.bfloat16)])
def test_fused_gate_up_and_down_equal_compressed_tensors(tmp_path, scale_dtype, dtype):
    shapes = {"gate_proj": (96, 130), "up_proj": (96, 130), "down_proj": (130, 96)}
    raw = _expert(shapes, scale_dtype)
    theirs = _dequantiser(tmp_path, dtype).process(dict(raw))
    gate_up = dequantise_rows([(raw[f"{P}.{p}.weight"], raw[f"{P}.{p}.weight_scale"]) for p in ("gate_proj", "up_proj")],
                              dtype)
    down = dequantise_rows([(raw[f"{P}.down_proj.weight"], raw[f"{P}.down_proj.weight_scale"])], dtype)
    _same_bits(gate_up, torch.cat([theirs[f"{P}.gate_proj.weight"], theirs[f"{P}.up_proj.weight"]]))
    _same_bits(down, theirs[f"{P}.down_proj.weight"])


def test_beam_expert_shapes_equal_compressed_tensors(tmp_path):
    shapes = {"gate_proj": (2560, 5120), "down_proj": (5120, 2560)}  # Beam-1.0's expert matrices
    raw = _expert(shapes, torch.float32, seed=1)
    theirs = _dequantiser(tmp_path, torch.float32).process(dict(raw))
    for p in shapes:
        _same_bits(dequantise_rows([(raw[f"{P}.{p}.weight"], raw[f"{P}.{p}.weight_scale"])], torch.float32),
                   theirs[f"{P}.{p}.weight"])


def test_odd_width_and_non_contiguous_weights(tmp_path):
    raw = _expert({"gate_proj": (40, 15)}, torch.float32)
    theirs = _dequantiser(tmp_path, torch.float32).process(dict(raw))
    w, s = raw[f"{P}.gate_proj.weight"], raw[f"{P}.gate_proj.weight_scale"]
    _same_bits(dequantise_rows([(w, s)], torch.float32), theirs[f"{P}.gate_proj.weight"])
    wide = _expert({"gate_proj": (40, 20)}, torch.float32)[f"{P}.gate_proj.weight"][:, :10]  # strided rows
    assert not wide.is_contiguous()
    _same_bits(dequantise_rows([(wide, s)], torch.float32), wide.to(torch.float32) * s)


def test_refuses_what_is_not_per_channel_fp8():
    w = torch.zeros((4, 8), dtype=FP8)
    with pytest.raises(ValueError, match=r"\[4, 1\] scales|\[4, 8\]"):
        dequantise_rows([(w, torch.ones((1, 8)))], torch.float32)
    with pytest.raises(ValueError, match="bfloat16"):
        dequantise_rows([(w.to(torch.bfloat16), torch.ones((4, 1)))], torch.float32)
