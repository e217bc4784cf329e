"""Port unit beam-exact-rounding on the vllm-gaudi tree named by GAUDI_FIXES_ROOT, on CPU.

The tree is copied and patched (the v0.30.0 fixes, then the port's units; "stock" is the tree with
the v0.30.0 fixes only), and a fresh interpreter imports its real `extension/ops.py` and
`ops/hpu_compressed_tensors.py` with the Habana modules stubbed. The Habana ops the FP8 paths
call are stand-ins: `cast_to_fp8_v2` is tests/support/gaudi/habana_ops.py's, after Habana's own card
test of it (the product in the input's dtype, then e4m3, saturated at the device's FP8 max), written
apart from beam_hpu.quant.rounding, whose Gaudi mode the stock tree's dynamic_quant is checked
against; `fp8_gemm_v2` is the scaled fp32 product of its operands. The fused
expert op only records what reaches it: the test is about the quantised input, not the experts.

Each layer is built as vLLM's loader leaves it (FP8 weights, per-channel scales, no input scale)
and processed by the tree's own `process_weights_after_loading` inside vLLM's current-config
context with a real ModelConfig (the trained tiny Beam, or a tiny Llama), as the worker does;
then the tree's own `apply_weights` (dense) or `VllmMixtureOfExpertsOpFP8PerChannel.forward`
(experts) quantises a bf16 activation. The MoE layer is a plain module holding the attributes
vLLM's FusedMoE gives the method (expert counts, ep_rank, weights), not vLLM's class.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from beam_hpu.quant.rounding import FP8_E4M3FN_MAX, GAUDI2_FP8_MAX, per_token_fp8
from tests.support.gaudi.tree import TINY_BEAM, run_stubbed, stock_and_port

pytestmark = pytest.mark.gaudi_tree
MODELS = ("beam", "llama")
MODES = ("0", "1")
PATHS = ("dense", "moe")

QUANTISE = r'''
import os, sys, torch
from types import SimpleNamespace
import habana_frameworks.torch.utils.experimental as htexp
if GAUDI2:  # the stub's device query answers Gaudi 2, as vllm-gaudi asks it at import
    htexp._get_device_type.return_value = htexp.synDeviceType.synDeviceGaudi2
import vllm_gaudi.extension.ops as ops
import vllm_gaudi.ops.hpu_compressed_tensors as ct
assert ops.__file__.startswith(ROOT) and ct.__file__.startswith(ROOT)
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
from vllm.config import set_current_vllm_config
from tests.support.gaudi import habana_ops as habana
from tests.support.gaudi.vllm_context import model_configs

seen = {}

def cast_to_fp8_v2(x, scale, stochastic_rounding=False, is_amax=False, dtype=torch.float8_e4m3fn):
    assert not stochastic_rounding and not is_amax
    return habana.cast_to_fp8_v2(x, scale, ops.FP8_MAX, dtype), None

def fp8_gemm_v2(A, trans_A, B, trans_B, D, out_dtype, A_scale_inv, B_scale_inv, bias, accumulate):
    seen.update(q=A, scale=A_scale_inv)
    b = B.float().t() if trans_B else B.float()
    out = (A.float() * A_scale_inv) @ (b * B_scale_inv.float())
    return (out if bias is None else out + bias).to(out_dtype)

def fused_experts(**kw):
    seen.update(q=kw["hidden_states"], scale=kw["d_scale_hidden_states"])
    return torch.zeros(kw["hidden_states"].shape, dtype=torch.bfloat16)

torch.ops.hpu = SimpleNamespace(cast_to_fp8_v2=cast_to_fp8_v2, fp8_gemm_v2=fp8_gemm_v2,
                                mixture_of_experts=SimpleNamespace(fp8_fused_weights_dynamic=fused_experts))

configs = model_configs(OUT, TINY)
channel = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False)
g = torch.Generator().manual_seed(0)
H, N, E, I = 64, 16, 2, 8

def fp8(shape):
    return (torch.randn(*shape, generator=g) * 100).clamp(-400, 400).to(torch.float8_e4m3fn)

def dense(x):
    scheme = ct.HPUCompressedTensorsW8A8Fp8(QuantizationStrategy.CHANNEL, False, channel)
    layer = torch.nn.Module()
    layer.scheme = scheme
    scheme.create_weights(layer, H, [N], H, N, torch.bfloat16, weight_loader=lambda p, w: p.data.copy_(w))
    layer.weight.data.copy_(fp8((N, H)))
    layer.weight_scale.data.copy_(torch.rand(N, 1, generator=g) / 100)
    scheme.process_weights_after_loading(layer)
    return lambda: scheme.apply_weights(layer, x)

def moe(x):
    method = ct.HPUCompressedTensorsW8A8Fp8MoEMethod.__new__(ct.HPUCompressedTensorsW8A8Fp8MoEMethod)
    method.weight_quant, method.block_quant, method.static_input_scales = channel, False, False
    layer = torch.nn.Module()
    layer.local_num_experts = layer.global_num_experts = E
    layer.moe_config = SimpleNamespace(ep_rank=0, is_act_and_mul=True)  # vLLM FusedMoEConfig: gated SwiGLU
    layer.w13_weight, layer.w2_weight = fp8((E, 2 * I, H)), fp8((E, H, I))
    layer.w13_weight_scale = torch.rand(E, 2 * I, 1, generator=g) / 100
    layer.w2_weight_scale = torch.rand(E, H, 1, generator=g) / 100
    layer.w13_input_scale = layer.w2_input_scale = None
    method.process_weights_after_loading(layer)
    ids = torch.randint(0, E, (x.shape[0], 2), generator=g)
    return lambda: layer.moe_op(x, ids, torch.full(ids.shape, 0.5, dtype=x.dtype))

x = torch.randn(5, H, generator=g).to(torch.bfloat16) * 3
x[1] *= 1e-9  # a row whose amax is small against vllm-gaudi's 1e-8
x[2, 7] = 0.0
out = {"x": x, "fp8_max": ops.FP8_MAX}
for model in MODELS:
    for mode in MODES:
        for path, build in (("dense", dense), ("moe", moe)):
            os.environ["BEAM_EXACT_ROUNDING"] = mode
            with set_current_vllm_config(configs[model]):
                run = build(x)
            os.environ["BEAM_EXACT_ROUNDING"] = "1" if mode == "0" else "0"  # read at load, not per call
            seen.clear()
            run()
            out[(model, mode, path)] = (seen["q"].view(torch.uint8).clone(), seen["scale"].clone())
torch.save(out, OUT)
print("done")
'''


def quantise_on(root: Path, out: Path, gaudi2: bool = True) -> dict:
    """Run QUANTISE on the tree at `root`: {(model, mode, path): (q bits, scale)}, x, fp8_max."""
    run_stubbed(root, QUANTISE, timeout=420, ROOT=str(root), OUT=str(out), TINY=str(TINY_BEAM), GAUDI2=gaudi2,
                MODELS=MODELS, MODES=MODES)
    return torch.load(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exact-rounding")
    stock, port = stock_and_port(tmp)
    return {"stock": quantise_on(stock, tmp / "stock.pt"), "port": quantise_on(port, tmp / "port.pt"),
            "port gaudi3": quantise_on(port, tmp / "port-g3.pt", gaudi2=False)}


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("path", PATHS)
def test_beam_with_exact_rounding_quantises_as_the_reference(runs, path):
    out = runs["port"]
    assert out["fp8_max"] == GAUDI2_FP8_MAX
    q, scale = out[("beam", "1", path)]
    want_q, want_scale = per_token_fp8(out["x"], GAUDI2_FP8_MAX, exact=True)
    assert torch.equal(q, bits(want_q)) and torch.equal(scale, want_scale)
    # The Gaudi 2 range: every row's largest element lands on 240, none beyond.
    values = q.view(torch.float8_e4m3fn).float().abs()
    assert torch.equal(values.amax(-1), torch.full((q.shape[0],), GAUDI2_FP8_MAX))
    # ... and it is not the stock rounding (bf16 scale, 1e-8): the test would see the port missing.
    assert not torch.equal(q, runs["stock"][("beam", "1", path)][0])


@pytest.mark.parametrize("path", PATHS)
def test_gaudi3_range_is_the_trees_fp8_max(runs, path):
    out = runs["port gaudi3"]
    assert out["fp8_max"] == FP8_E4M3FN_MAX
    q, scale = out[("beam", "1", path)]
    want_q, want_scale = per_token_fp8(out["x"], FP8_E4M3FN_MAX, exact=True)
    assert torch.equal(q, bits(want_q)) and torch.equal(scale, want_scale)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("model,mode", [("beam", "0"), ("llama", "0"), ("llama", "1")])
def test_stock_rounding_otherwise(runs, path, model, mode):
    """Switch off, or another model with it on: the patched tree quantises exactly as the stock
    tree does, and that is vllm-gaudi's dynamic_quant (the rounding of mode 0)."""
    q, scale = runs["port"][(model, mode, path)]
    stock_q, stock_scale = runs["stock"][(model, mode, path)]
    assert torch.equal(q, stock_q) and torch.equal(scale, stock_scale)
    want_q, want_scale = per_token_fp8(runs["port"]["x"], GAUDI2_FP8_MAX, exact=False)
    assert torch.equal(q, bits(want_q)) and torch.equal(scale, want_scale)


def test_stock_tree_ignores_the_switch(runs):
    # Without the unit the switch changes nothing on HPU: what the unit is for.
    for path in PATHS:
        assert torch.equal(runs["stock"][("beam", "1", path)][0], runs["stock"][("beam", "0", path)][0])
