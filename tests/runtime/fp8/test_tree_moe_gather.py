"""Port unit beam-moe-gather on the vllm-gaudi tree named by GAUDI_FIXES_ROOT, on CPU.

The tree is copied and patched (the v0.30.0 fixes, then the port's units; "stock" is the tree
with the v0.30.0 fixes only) and a fresh interpreter imports its real `extension/ops.py` and
`ops/hpu_compressed_tensors.py` with the Habana modules stubbed. Each MoE layer is built as vLLM's
loader leaves it (FP8 weights, per-channel scales, no input scale) and processed by the tree's own
`process_weights_after_loading` inside vLLM's current-config context (the trained tiny Beam, or a
tiny Llama), then the tree's own `apply_monolithic` routes bf16 activations (softmax top-k) and
computes the experts.

The Habana ops are given by their definitions (our model of the kernels, nothing runs on a card):
- `cast_to_fp8_v2`: x times the given reciprocal scale in fp32, saturated at FP8_MAX, nearest even;
- `fp8_gemm_v2`: the product of the FP8 operands accumulated exactly (float64: e4m3 products and
  their sums over these widths are exact, so no summation order is assumed), then times the A
  (token) and B (channel) scales in fp32;
- `mixture_of_experts.fp8_fused_weights_dynamic`, the fused op over every local expert: for each
  token, each of its top-k ids within [experts_min, experts_max] in ascending id order: the up GEMM
  (fp8_gemm_v2 above) to bf16, SwiGLU in fp32 to bf16, that quantised per token by dynamic_quant,
  the down GEMM, times the router weight, summed in fp32; the result in bf16. That the kernel
  quantises its intermediate per token is the model this test assumes (see the unit's changes).
The op also counts its calls, so the test sees which path a step took.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.gaudi.tree import TINY_BEAM, run_stubbed, stock_and_port

pytestmark = pytest.mark.gaudi_tree

TOKENS = (1, 2, 4, 8, 16)
LIMITS = (0, 1, 2, 16)

RUN = r'''
import os, sys, torch
from types import SimpleNamespace
import habana_frameworks.torch.utils.experimental as htexp
htexp._get_device_type.return_value = htexp.synDeviceType.synDeviceGaudi2
import vllm_gaudi.extension.ops as ops
import vllm_gaudi.ops.hpu_compressed_tensors as ct
assert ops.__file__.startswith(ROOT) and ct.__file__.startswith(ROOT)
from compressed_tensors.quantization import QuantizationArgs
from vllm.config import set_current_vllm_config
from tests.support.gaudi.vllm_context import model_configs

calls = {"fused": 0}

def cast_to_fp8_v2(x, scale, stochastic_rounding=False, is_amax=False, dtype=torch.float8_e4m3fn):
    assert not stochastic_rounding and not is_amax
    return (x.float() * scale.float()).clamp(-ops.FP8_MAX, ops.FP8_MAX).to(dtype), None

def fp8_gemm_v2(A, trans_A, B, trans_B, D, out_dtype, A_scale_inv, B_scale_inv, bias, accumulate,
                B_scale_shape=None):
    assert not trans_A and D is None and bias is None and not accumulate
    b = B.double().t() if trans_B else B.double()
    out = (A.double() @ b).float() * A_scale_inv.float() * B_scale_inv.float().reshape(1, -1)
    return out.to(out_dtype)

def fused_experts(hidden_states, expert_routing_table, router_weights, w12, w3, d_scale_hidden_states,
                  d_scale_w12, d_scale_w3, permuted_weights, activation, experts_min, experts_max, **kw):
    assert permuted_weights and activation == "silu" and not kw
    calls["fused"] += 1
    out = torch.zeros(hidden_states.shape, dtype=torch.float32)
    for t in range(hidden_states.shape[0]):
        row, scale = hidden_states[t:t + 1], d_scale_hidden_states[t:t + 1]
        for e, w in sorted(zip(expert_routing_table[t].tolist(), router_weights[t].float().tolist())):
            if not experts_min <= e <= experts_max:
                continue
            i = e - experts_min
            h = fp8_gemm_v2(row, False, w12[i], True, None, torch.float32, scale, d_scale_w12[i], None, False)
            gate, up = h.to(torch.bfloat16).chunk(2, -1)
            act = (torch.nn.functional.silu(gate.float()) * up.float()).to(torch.bfloat16)
            a_fp8, a_scale = ops.dynamic_quant(act)
            y = fp8_gemm_v2(a_fp8, False, w3[i], True, None, torch.float32, a_scale, d_scale_w3[i], None, False)
            out[t] += y[0] * torch.tensor(w, dtype=torch.float32)
    return out.to(torch.bfloat16)

torch.ops.hpu = SimpleNamespace(cast_to_fp8_v2=cast_to_fp8_v2, fp8_gemm_v2=fp8_gemm_v2,
                                mixture_of_experts=SimpleNamespace(fp8_fused_weights_dynamic=fused_experts))

configs = model_configs(OUT, TINY)
channel = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False)
H, I, E_LOCAL, TOP_K = 64, 32, 16, 4

def layer_for(model, ep_rank, ep_size, seed):
    g = torch.Generator().manual_seed(seed)
    def fp8(*shape):
        return (torch.randn(*shape, generator=g) * 60).clamp(-240, 240).to(torch.float8_e4m3fn)
    method = ct.HPUCompressedTensorsW8A8Fp8MoEMethod.__new__(ct.HPUCompressedTensorsW8A8Fp8MoEMethod)
    method.weight_quant, method.block_quant, method.static_input_scales = channel, False, False
    layer = torch.nn.Module()
    layer.local_num_experts, layer.global_num_experts = E_LOCAL, E_LOCAL * ep_size
    layer.moe_config = SimpleNamespace(ep_rank=ep_rank, is_sequence_parallel=False)
    layer.top_k, layer.use_grouped_topk, layer.custom_routing_function = TOP_K, False, None
    layer.activation = "silu"
    layer.w13_weight, layer.w2_weight = fp8(E_LOCAL, 2 * I, H), fp8(E_LOCAL, H, I)
    layer.w13_weight_scale = torch.rand(E_LOCAL, 2 * I, 1, generator=g) / 50 + 1e-3
    layer.w2_weight_scale = torch.rand(E_LOCAL, H, 1, generator=g) / 50 + 1e-3
    layer.w13_input_scale = layer.w2_input_scale = None
    with set_current_vllm_config(configs[model]):
        method.process_weights_after_loading(layer)
    return method, layer

out = {}
for model in MODELS:
    for limit in LIMITS:
        for ep_rank, ep_size in ((0, 1), (1, 4)):  # EP: rank 1 of 4 holds global experts 16..31
            os.environ["BEAM_MOE_GATHER"] = str(limit)
            method, layer = layer_for(model, ep_rank, ep_size, seed=ep_rank)
            os.environ["BEAM_MOE_GATHER"] = "0" if limit else "16"  # read at load, not per step
            for tokens in TOKENS:
                g = torch.Generator().manual_seed(100 + tokens)
                x = (torch.randn(tokens, H, generator=g) * 3).to(torch.bfloat16)
                logits = torch.randn(tokens, E_LOCAL * ep_size, generator=g)
                if ep_size > 1 and tokens == 2:
                    logits[:, 16:32] -= 100  # no token routes to this rank
                calls["fused"] = 0
                y = method.apply_monolithic(layer, x, logits)
                out[(model, limit, ep_rank, tokens)] = (y.view(torch.int16).clone(), calls["fused"])
torch.save(out, OUT)
print("done")
'''


def run_on(root: Path, out: Path, models=("beam", "llama")) -> dict:
    """{(model, limit, ep_rank, tokens): (output bits, fused-op calls)} from RUN on the tree at root."""
    run_stubbed(root, RUN, timeout=600, ROOT=str(root), OUT=str(out), TINY=str(TINY_BEAM), MODELS=models,
                LIMITS=LIMITS, TOKENS=TOKENS)
    return torch.load(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe-gather")
    stock, port = stock_and_port(tmp)
    return {"stock": run_on(stock, tmp / "stock.pt"), "port": run_on(port, tmp / "port.pt")}


@pytest.mark.parametrize("ep_rank", [0, 1])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("limit", LIMITS)
def test_beam_output_is_the_stock_paths_and_the_switch_picks_the_path(runs, limit, ep_rank, tokens):
    got, fused_calls = runs["port"][("beam", limit, ep_rank, tokens)]
    want, stock_calls = runs["stock"][("beam", limit, ep_rank, tokens)]
    assert torch.equal(got, want), (limit, ep_rank, tokens)
    assert stock_calls == 1  # the stock tree always calls the fused op
    gathered = 0 < tokens <= limit
    assert fused_calls == (0 if gathered else 1), (limit, tokens)


def test_the_outputs_are_not_trivial(runs):
    # Nonzero where tokens route to the rank, exact zeros where none does (EP rank 1, 2 tokens).
    for limit in LIMITS:
        for ep_rank in (0, 1):
            for tokens in TOKENS:
                bits, _ = runs["port"][("beam", limit, ep_rank, tokens)]
                y = bits.view(torch.bfloat16).float()
                if ep_rank == 1 and tokens == 2:
                    assert torch.equal(y, torch.zeros_like(y))
                else:
                    assert y.abs().amax() > 0


@pytest.mark.parametrize("limit", LIMITS)
def test_another_model_always_takes_the_fused_op(runs, limit):
    for ep_rank in (0, 1):
        for tokens in TOKENS:
            got, fused_calls = runs["port"][("llama", limit, ep_rank, tokens)]
            assert fused_calls == 1
            assert torch.equal(got, runs["stock"][("llama", limit, ep_rank, tokens)][0])
