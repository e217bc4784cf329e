"""vLLM's layers as a Gaudi node runs them, on CPU, in a fresh interpreter (tree.run_stubbed).

On a node vLLM finds vllm-gaudi's platform through its `vllm.platform_plugins` entry point
(vllm-gaudi's setup.py: `hpu = vllm_gaudi:register`) when `import vllm` first asks for the current
platform, and the plugin's `register_ops()` fills vLLM's out-of-tree registry. Here the same: the
tree copy gets the entry point (`add_platform_entry_point`, written beside its vllm_gaudi/ as an
installed distribution would have it), `install()` lets vLLM pick its platform as it does on a node,
then calls the tree's own `register_ops()`. So vLLM's CustomOp classes build vllm-gaudi's
subclasses (`RotaryEmbedding(...)` is an HPURotaryEmbedding), every enabled CustomOp dispatches to
`forward_oot`, and a VllmConfig takes the platform's settings (custom_ops ["all"]). The Habana
kernels those classes import, and the torch.ops.hpu ops they call (the unquantised and FP8 fused
MoE, the FP8 cast and GEMM), are tests/support/gaudi/habana_ops.py's stand-ins; what vllm-gaudi
leaves to vLLM (unquantised linears: F.linear, the platform being neither CPU nor CUDA) runs as
vLLM's own code.
"""
from __future__ import annotations

import os
import sys
import types
from pathlib import Path

DIST_INFO = "vllm_gaudi-0.0.0+tree.dist-info"


def add_platform_entry_point(root: Path) -> None:
    """The tree copy at `root` as an installed vllm-gaudi's platform plugin (its setup.py's entry)."""
    info = root / DIST_INFO
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm_gaudi\nVersion: 0.0.0+tree\n")
    (info / "entry_points.txt").write_text("[vllm.platform_plugins]\nhpu = vllm_gaudi:register\n")


def _hpex_stand_ins() -> None:
    """habana_frameworks.torch.hpex.{kernels,normalization} with the stand-ins the layers import;
    a kernel not stood in is missing there, so vllm-gaudi's loaders (extension/kernels.py) see an
    ImportError, as without the kernel, instead of a mock."""
    from tests.support.gaudi import habana_ops

    kernels = types.ModuleType("habana_frameworks.torch.hpex.kernels")
    kernels.RotaryPosEmbeddingMode = habana_ops.RotaryPosEmbeddingMode
    kernels.apply_rotary_pos_emb = habana_ops.apply_rotary_pos_emb
    normalization = types.ModuleType("habana_frameworks.torch.hpex.normalization")
    normalization.FusedRMSNorm = habana_ops.FusedRMSNorm
    hpex = types.ModuleType("habana_frameworks.torch.hpex")
    hpex.kernels, hpex.normalization = kernels, normalization
    sys.modules.update({m.__name__: m for m in (hpex, kernels, normalization)})


def install():
    """Run first in the child (after habana_stub.install(), before anything imports vLLM); returns
    vLLM's current platform, the tree's HpuPlatform."""
    import torch
    from torch._dynamo.backends.registry import register_backend

    _hpex_stand_ins()
    # HpuPlatform.simple_compile_backend names the backend the bridge registers on a card; vLLM
    # only decorates a few helpers with it at import, none of which the tree tests run.
    register_backend(name="hpu_backend")(lambda graph, example_inputs: graph.forward)
    # run_stubbed's explicit CPU target would make vLLM skip its platform plugins.
    os.environ.pop("VLLM_TARGET_DEVICE", None)
    import vllm.platforms

    platform = vllm.platforms.current_platform
    if type(platform).__name__ != "HpuPlatform" or not type(platform).__module__.startswith("vllm_gaudi"):
        raise RuntimeError(f"vLLM chose {type(platform).__module__}.{type(platform).__name__}, not the tree's "
                           f"HpuPlatform (is the tree copy on sys.path with {DIST_INFO}?)")
    import vllm_gaudi

    vllm_gaudi.register_ops()
    return platform


class HpuOps:
    """torch.ops.hpu in a tree child: the stand-ins of habana_ops.py by op name, every other name
    an AttributeError naming the op (what a missing op is, so vllm-gaudi's own fallbacks behave as
    without it), and each such name kept in `missing`, so a test can tell which ops its forward
    asked for and found no stand-in for."""

    def __init__(self, **ops):
        self._ops = ops
        self.missing: list[str] = []

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._ops:
            self.missing.append(name)
            raise AttributeError(f"torch.ops.hpu.{name}: no stand-in in tests/support/gaudi/habana_ops.py")
        return self._ops[name]


def _cast_to_fp8_v2(input, scale, stochastic_rounding=False, is_amax=False, dtype=None):
    """torch.ops.hpu.cast_to_fp8_v2 as vllm-gaudi calls it (round to nearest, no amax): the stand-in's
    cast saturated at the tree's FP8_MAX (Gaudi 2's e4m3 range, 240, under VLLM_HW gaudi2), and no
    amax output."""
    import torch

    from tests.support.gaudi import habana_ops
    from vllm_gaudi.extension.ops import FP8_MAX

    if stochastic_rounding or is_amax:
        raise NotImplementedError("cast_to_fp8_v2: only round-to-nearest without amax is stood in")
    return habana_ops.cast_to_fp8_v2(input, scale, FP8_MAX, dtype or torch.float8_e4m3fn), None


def _fp8_gemm_v2(A, trans_A, B, trans_B, D, out_dtype, A_scale_inv=None, B_scale_inv=None, bias=None,
                 accumulate=False, B_scale_shape=None):
    """torch.ops.hpu.fp8_gemm_v2 without D or accumulate (how vllm-gaudi's FP8 linears call it)."""
    from tests.support.gaudi import habana_ops

    if D is not None or accumulate:
        raise NotImplementedError("fp8_gemm_v2: D and accumulate are not stood in")
    return habana_ops.fp8_gemm_v2(A, trans_A, B, trans_B, out_dtype, A_scale_inv, B_scale_inv, bias)


def _mixture_of_experts(**kwargs):
    """torch.ops.hpu.mixture_of_experts, the overload picked by the call's argument names: `fused_weights`
    (w12 and w3, no scales) and `fp8_fused_weights_dynamic` (FP8 w12 and w3 with per-channel scales, the
    hidden states' per-token scale, no intermediate scale) are stood in."""
    from tests.support.gaudi import habana_ops

    scales = {k for k in kwargs if k.startswith("d_scale")}
    if "w12" not in kwargs or any(k.endswith("_bias") for k in kwargs):
        raise NotImplementedError(f"torch.ops.hpu.mixture_of_experts with arguments {sorted(kwargs)}: "
                                  "no stand-in for that overload")
    if not scales:
        return habana_ops.mixture_of_experts_fused_weights(**kwargs)
    if scales != {"d_scale_hidden_states", "d_scale_w12", "d_scale_w3"}:
        raise NotImplementedError(f"torch.ops.hpu.mixture_of_experts with scales {sorted(scales)}: "
                                  "only the dynamic per-channel FP8 overload is stood in")
    from vllm_gaudi.extension.ops import FP8_MAX, dynamic_quant

    k = dict(kwargs)
    if not k.pop("permuted_weights") or k.pop("activation") != "silu":
        raise NotImplementedError("fp8 mixture_of_experts: only permuted weights with SiLU are stood in")
    k.pop("chunk_size", None), k.pop("total_experts", None)  # the kernel's tiling, not its result
    return habana_ops.fused_fp8_moe_eager(
        k.pop("hidden_states"), k.pop("d_scale_hidden_states"), k.pop("expert_routing_table"),
        k.pop("router_weights"), k.pop("w12"), k.pop("d_scale_w12"), k.pop("w3"), k.pop("d_scale_w3"),
        k.pop("experts_min"), k.pop("experts_max"), FP8_MAX, dynamic_quant)


def install_hpu_ops() -> HpuOps:
    import torch

    torch.ops.hpu = HpuOps(mixture_of_experts=_mixture_of_experts, cast_to_fp8_v2=_cast_to_fp8_v2,
                           fp8_gemm_v2=_fp8_gemm_v2)
    return torch.ops.hpu
