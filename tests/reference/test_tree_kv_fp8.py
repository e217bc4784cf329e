"""FP8 KV cache on the vllm-gaudi tree named by GAUDI_FIXES_ROOT, on CPU: the calibrated scales through
vllm-gaudi's own `HPUCompressedTensorsKVCacheMethod`, and `beam-fsdpa-tiles` around its
`ModuleFP8FusedSDPA` (what prompt attention runs with `--kv-cache-dtype fp8_inc`).

The tree's classes are taken from its files (`vllm_gaudi/ops/hpu_compressed_tensors.py`,
`vllm_gaudi/extension/utils.py`) and run with vLLM 0.30.0's real `CompressedTensorsKVCacheMethod`
as base; the Habana ops are stand-ins with our model of them: `cast_to_fp8_v2(x, s)` =
tests/support/gaudi/habana_ops.py's (after Habana's card test: e4m3 of x * s taken in x's dtype,
saturated at +-240), `cast_from_fp8(x, s)` = x * s, and the
FP8 FusedSDPA kernel = torch SDPA of the dequantised inputs (its internal FP8 rounding of the
softmax, scale_amax 1.0, is not modelled: a card run must confirm it).
"""
from __future__ import annotations

import ast
from types import SimpleNamespace

import pytest
import torch

from beam_hpu.model.beam import KV_CACHE_SCALE
from beam_hpu.quant.rounding import GAUDI2_FP8_MAX, fp8_kv_round, kv_device_step
from beam_hpu.reference.kv_overlay import SHARD_NAME, tensor_name, write_overlay
from tests.support.gaudi import habana_ops, prompt_attention
from tests.support.gaudi.prompt_attention import CASES, D, PromptAttention
from tests.support.gaudi.source import run_statements
from tests.support.gaudi.tree import port_tree_fixture

pytestmark = pytest.mark.gaudi_tree
tree = port_tree_fixture("module")  # the prompt attention's tree, without and with the port

CT = "vllm_gaudi/ops/hpu_compressed_tensors.py"
UTILS = "vllm_gaudi/extension/utils.py"
FP8_CLASSES = ["VLLMKVCache", "VLLMFP8KVCache", "FP8Matmul", "SlicedFusedSDPABase", "SlicedFP8FusedSDPA",
               "ModuleFP8FusedSDPA"]


def load_classes(path, names, **globals_) -> dict:
    """The classes `names` of the file at `path`, defined in one namespace with `globals_`."""
    tree_ = ast.parse(path.read_text())
    nodes = {n.name: n for n in tree_.body if isinstance(n, ast.ClassDef)}
    namespace = run_statements([nodes[n] for n in names], path, dict(globals_))
    return {n: namespace[n] for n in names}


class HabanaOps:
    """torch.ops.hpu as the tree's FP8 classes call it, with our model of each op."""

    def __init__(self):
        self.kernel_calls = []

    @staticmethod
    def cast_to_fp8_v2(x, scale, stochastic, is_amax, dtype):
        assert not stochastic and dtype == torch.float8_e4m3fn
        return habana_ops.cast_to_fp8_v2(x, torch.as_tensor(scale, dtype=torch.float32), GAUDI2_FP8_MAX), None

    @staticmethod
    def cast_from_fp8(x, scale, dtype):
        return (x.float() * torch.as_tensor(scale, dtype=torch.float32)).to(dtype)

    def fp8_fused_sdpa(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, softmax_mode=None,
                       d_scale_q=None, d_scale_k=None, d_scale_v=None, q_scale_s=None, d_scale_s=None, is_amax_s=False,
                       valid_seq_len=None, seq_padding_type=None):
        assert q.dtype == k.dtype == v.dtype == torch.float8_e4m3fn and dropout_p == 0.0
        self.kernel_calls.append((tuple(q.shape), tuple(k.shape), tuple(attn_mask.shape)))
        q, k, v = (x.float() * s for x, s in ((q, d_scale_q), (k, d_scale_k), (v, d_scale_v)))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask.to(q.dtype), scale=scale,
                                                               enable_gqa=True)
        return (out,)


class TorchWithHabana:
    """`torch` for the tree's classes: torch itself, with torch.ops.hpu the stand-ins."""

    def __init__(self, hpu):
        self.ops = SimpleNamespace(hpu=hpu)

    def __getattr__(self, name):
        return getattr(torch, name)


def kv_method_and_layer(tree_root, hpu, k_scale, v_scale, q_scale):
    """vllm-gaudi's KV-cache method with the tree's FP8 submodules on a stand-in Attention layer,
    its scale parameters loaded from a calibrated overlay's tensors by vLLM's default loader."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsKVCacheMethod)
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    config = SimpleNamespace(use_contiguous_pa=False, enable_fsdpa_slicing=False, scale_adjustment=True)
    get_config = lambda: config  # noqa: E731
    fake_torch = TorchWithHabana(hpu)
    utils = load_classes(tree_root / UTILS, FP8_CLASSES, torch=fake_torch, get_config=get_config,
                         logger=lambda: SimpleNamespace(warning_once=print))
    (method_cls,) = load_classes(tree_root / CT, ["HPUCompressedTensorsKVCacheMethod"], torch=torch,
                                 Optional=__import__("typing").Optional, get_config=get_config,
                                 CompressedTensorsKVCacheMethod=CompressedTensorsKVCacheMethod,
                                 hpu_ops=SimpleNamespace(FP8_MAX=GAUDI2_FP8_MAX),
                                 logger=SimpleNamespace(debug_once=lambda *a: None)).values()
    # HPUCompressedTensorsConfig sets kv_cache_scheme to None once it has chosen fp8_inc.
    method = method_cls(SimpleNamespace(kv_cache_scheme=None))
    layer = torch.nn.Module()
    layer._k_scale_cpu, layer._v_scale_cpu = torch.zeros(()), torch.zeros(())
    method.create_weights(layer)
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale), ("q_scale", q_scale)):
        default_weight_loader(getattr(layer, name), value)
    layer.impl = SimpleNamespace(k_cache=utils["VLLMFP8KVCache"](), v_cache=utils["VLLMFP8KVCache"](),
                                 matmul_qk=utils["FP8Matmul"](), matmul_av=utils["FP8Matmul"](),
                                 fused_scaled_dot_product_attention=utils["ModuleFP8FusedSDPA"](hpu.fp8_fused_sdpa))
    method.process_weights_after_loading(layer)
    return layer


@pytest.fixture(scope="module")
def overlay_scales(tmp_path_factory):
    """(k, v, q) scale tensors of layer 2 as `beam-hpu calibrate-kv`'s overlay stores them."""
    from safetensors.torch import load_file

    from beam_hpu.quant.fp8_checkpoint import quantize_checkpoint
    from beam_hpu.tiny.checkpoint import TRAINED_DIR

    root = tmp_path_factory.mktemp("kv-overlay")
    fp8 = quantize_checkpoint(TRAINED_DIR, root / "fp8")
    scales = {i: {"k": 0.0071 * (i + 1), "v": 0.0049 * (i + 1), "q": 0.0093} for i in range(5)}
    out = write_overlay(fp8, root / "overlay", scales, {"test": "1"})
    tensors = load_file(out / SHARD_NAME)
    return tuple(tensors[tensor_name(2, kind)] for kind in ("k", "v", "q"))


def test_the_overlays_names_reach_the_attention_layer():
    mapped = KV_CACHE_SCALE.sub(r".self_attn.attn.\1_scale", tensor_name(7, "k"))
    assert mapped == "model.layers.7.self_attn.attn.k_scale"


def test_vllm_gaudi_receives_the_calibrated_scales(tree, overlay_scales):
    k, v, q = overlay_scales
    layer = kv_method_and_layer(tree.root, HabanaOps(), k, v, q)
    impl = layer.impl
    for x, cache, fsdpa_scale, fsdpa_descale in ((k, impl.k_cache, "scale_k", "d_scale_k"),
                                                 (v, impl.v_cache, "scale_v", "d_scale_v")):
        # vllm-gaudi: amax = scale * 448 (scale adjustment on), cache input scale 240 / amax
        step = kv_device_step(float(x), GAUDI2_FP8_MAX)
        assert float(cache.input_scale) == pytest.approx(1 / step, rel=1e-6)
        assert float(cache.output_scale) == pytest.approx(step, rel=1e-6)
        assert float(getattr(impl.fused_scaled_dot_product_attention, fsdpa_scale)) == pytest.approx(1 / step, rel=1e-6)
        assert float(getattr(impl.fused_scaled_dot_product_attention, fsdpa_descale)) == pytest.approx(step, rel=1e-6)
    assert float(impl.matmul_qk.scale_input) == pytest.approx(1 / kv_device_step(float(q), GAUDI2_FP8_MAX), rel=1e-6)
    # The cache write is our rounding definition at Gaudi 2's range (fast path: times 1 / step).
    x = torch.randn(64, 1, 32, generator=torch.Generator().manual_seed(0)) * 3
    written = impl.k_cache.quant_input(x)
    read = HabanaOps.cast_from_fp8(written, impl.k_cache.output_scale, torch.float32)
    expected = fp8_kv_round(x, float(k), GAUDI2_FP8_MAX, exact=False)
    assert float((read - expected).abs().max()) <= float(expected.abs().max()) * 2**-3  # one e4m3 step at most
    assert float((read != expected).float().mean()) < 0.01  # the reciprocals agree but for rare ulps


@pytest.mark.parametrize("ctx_len,seq_len,sliding", CASES)
def test_fp8_tiles_are_the_untiled_fp8_definition(tree, overlay_scales, monkeypatch, ctx_len, seq_len,
                                                   sliding):
    k, v, q = overlay_scales
    runs = {}
    for ws in ("0", "0.004"):
        hpu = HabanaOps()
        module = kv_method_and_layer(tree.root, hpu, k, v, q).impl.fused_scaled_dot_product_attention
        inputs = []
        forward = module.forward

        def recording(*args, forward=forward, inputs=inputs):
            inputs.append(args[:4])
            return forward(*args)

        module.forward = recording
        module.calls = hpu.kernel_calls
        monkeypatch.setattr(prompt_attention, "StandInFusedSDPA", lambda module=module: module)
        monkeypatch.setenv("BEAM_FSDPA_WS_GIB", ws)
        monkeypatch.setenv("BEAM_FSDPA_Q_TILE", "256")
        out, calls = PromptAttention(tree)(ctx_len, seq_len, sliding)
        runs[ws] = out, list(calls), inputs
    (stock, stock_calls, (whole,)), (tiled, tiled_calls, _) = runs["0"], runs["0.004"]
    assert len(stock_calls) == 1 and (len(tiled_calls) > 1) == tree.port
    torch.testing.assert_close(tiled, stock, rtol=1e-5, atol=1e-5)
    # The untiled FP8 definition: Q, K and V rounded with their steps, then attention.
    query, key, value, bias = whole
    qr, kr, vr = (fp8_kv_round(x, float(s), GAUDI2_FP8_MAX, exact=False) for x, s in ((query, q), (key, k), (value, v)))
    scale = D**-0.5
    definition = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, attn_mask=bias.float(), scale=scale,
                                                                  enable_gqa=True)
    unrounded = torch.nn.functional.scaled_dot_product_attention(query.float(), key.float(), value.float(),
                                                                 attn_mask=bias.float(), scale=scale, enable_gqa=True)
    b, hq, rows, d = definition.shape
    tiled_bhsd = tiled.reshape(b, rows, hq, d).transpose(1, 2)  # prompt_attention returns [B, S, Hq, D]
    rounding = float((definition - unrounded).abs().max())
    # The definition to fp32 sums (measured ~1e-6 of what the rounding moves), not the unrounded result.
    assert float((tiled_bhsd - definition).abs().max()) < 1e-3 * rounding
