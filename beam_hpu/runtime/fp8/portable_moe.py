"""FP8 experts for platforms where vLLM 0.30.0 has no FP8 MoE kernel for the checkpoint's scheme.

The published checkpoint's experts are compressed-tensors W8A8 FP8: per-channel weight scales,
dynamic per-token activations. vLLM picks a kernel for that in `select_fp8_moe_backend`; on CPU
none qualifies (its FP8 CPU experts are block-128 W8A16 on AMX only), the backend comes back
NONE and loading stops with `Unsupported FP8 MoE backend: NONE`.

`PortableFp8MoEMethod` takes over exactly there (backend NONE, channel weights, dynamic token
activations) and computes what an FP8 expert kernel computes:
  x -> per-token FP8 (beam_hpu.quant.rounding, as switch BEAM_EXACT_ROUNDING says) -> FP8 x FP8
  GEMM with fp32 accumulate (torch._scaled_mm) -> * token scale * channel scale -> SwiGLU in fp32 ->
  per-token FP8 again -> down GEMM likewise -> weighted sum over the token's experts in fp32.
Weights stay FP8 in memory; nothing is upcast ahead of time.

Where each path is chosen, and why:
- CPU (backend NONE), Beam only: this method, chosen by `portable_replacement` from the runtime
  patch `portable-fp8-moe` (beam_hpu/runtime/fp8/patch_portable_moe.py). Any other model keeps vLLM's
  method, whose backend NONE then refuses the model at load (`Unsupported FP8 MoE backend: NONE`,
  before any request), as without the plugin: this method has no shared-expert path, and
  nothing of ours is tested on another model's experts.
- HPU: vllm-gaudi swaps in its own compressed-tensors config and MoE method
  (HPUCompressedTensorsW8A8Fp8MoEMethod on torch.ops.hpu.mixture_of_experts); vLLM's
  `CompressedTensorsMoEMethod.get_moe_method` is not the one asked, and even if it were the
  backend check below would not match an HPU method. Nothing here runs on Gaudi.
- CUDA and any platform with a native backend: backend is not NONE, vLLM's method stays.

Expert parallel: `layer.expert_map` maps global expert ids to this rank's local ids (-1 for
experts held elsewhere); the method computes only local experts and the MoE runner sums ranks.

Switch BEAM_MOE_GATHER (read once per layer at load): a step of at most that many tokens goes
through beam_hpu.runtime.fp8.hpu_moe_gather.gathered_fp8_moe, the function the Gaudi port unit beam-moe-gather
calls, so a served CPU engine runs it; larger steps (and 0) take `fp8_experts_forward`. Both
compute the same arithmetic (tests/runtime/fp8/test_hpu_moe_gather.py), so greedy outputs do not change
(tests/e2e/test_moe_gather_serve.py). The first gathered call for each token count logs a line.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping

import torch

from beam_hpu.runtime.fp8 import hpu_moe_gather as moe_gather
from beam_hpu.model.ops import swiglu_fp32
from beam_hpu.quant.rounding import FP8_E4M3FN_MAX, per_token_fp8
from beam_hpu.settings import switches

logger = logging.getLogger("vllm.beam_hpu.fp8")

def activation_quantiser(env: Mapping[str, str] | None = None):
    """x -> (e4m3fn, fp32 scale [T, 1]) per token, in the rounding switch BEAM_EXACT_ROUNDING names
    (1: the per-token reference's, 0: vllm-gaudi's fast path), so a served CPU engine and the
    reference loaded with the same `exact` round alike. Range: the CPU's e4m3fn, 448."""
    return functools.partial(per_token_fp8, fp8_max=FP8_E4M3FN_MAX,
                             exact=switches.current("BEAM_EXACT_ROUNDING", env))


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Global expert ids [T, k] -> this rank's local ids (-1: held by another rank)."""
    if expert_map is None:
        return topk_ids
    return expert_map[topk_ids.long()].to(topk_ids.dtype)


def fp8_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """[n, K] fp8 (scale [n, 1]) @ [N, K]^T fp8 (scale [N, 1]) -> [n, N] fp32.

    The GEMM runs on FP8 operands with fp32 accumulate; both scales are applied to the fp32
    result (torch's CPU _scaled_mm takes only scalar scales, as vLLM's channel-wise fallback notes).
    """
    one = torch.ones((), dtype=torch.float32, device=x_fp8.device)
    acc = torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    return acc * x_scale.float() * w_scale.float().view(1, -1)


def fp8_experts_forward(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, expert_map, quant_per_token):
    """Routed experts on FP8 weights. x [T, H]; w13 [E_local, 2I, H]; w2 [E_local, H, I];
    scales [E_local, rows, 1]; topk_* [T, k] with global ids. Returns [T, H] in x.dtype."""
    ids = local_expert_ids(topk_ids, expert_map)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    x_fp8, x_scale = quant_per_token(x)
    for expert in ids.unique().tolist():
        if expert < 0:
            continue  # another rank's expert: its contribution arrives in the runner's reduce
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        gate_up = fp8_gemm(x_fp8[tokens], x_scale[tokens], w13[expert], w13_scale[expert]).to(x.dtype)
        act = swiglu_fp32(gate_up)  # [n, I] in x.dtype
        a_fp8, a_scale = quant_per_token(act)
        y = fp8_gemm(a_fp8, a_scale, w2[expert], w2_scale[expert])
        out.index_add_(0, tokens, y * topk_weights[tokens, slots, None].float())
    return out.to(x.dtype)


@functools.cache  # one class per process: vLLM compares method types
def _method_class():
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w8a8_fp8 import (  # noqa: E501
        CompressedTensorsW8A8Fp8MoEMethod,
    )

    class PortableFp8MoEMethod(CompressedTensorsW8A8Fp8MoEMethod):
        """W8A8 FP8 experts (channel weights, dynamic per-token activations) without a native kernel."""

        def __init__(self, weight_quant, input_quant, moe, layer_name=None):
            super().__init__(weight_quant, input_quant, moe, layer_name)
            # Read once per layer at load: an engine's environment does not change while it runs.
            self.quant_per_token = activation_quantiser()
            self.gather_limit = moe_gather.gather_limit()
            self.gathered_sizes_logged: set[int] = set()

        @property
        def is_monolithic(self) -> bool:
            return False  # the runner routes first, then calls apply() with top-k ids

        def process_weights_after_loading(self, layer) -> None:
            # The loaded layout is the compute layout: no kernel-format conversion, no upcast.
            for name, rows in (("w13", layer.w13_weight.shape[1]), ("w2", layer.w2_weight.shape[1])):
                scale = getattr(layer, f"{name}_weight_scale")
                expected = (layer.w13_weight.shape[0], rows, 1)
                if tuple(scale.shape) != expected or scale.dtype != torch.float32:
                    raise ValueError(f"{getattr(layer, 'layer_name', 'experts')}.{name}_weight_scale: expected fp32 {expected}, "
                                     f"got {scale.dtype} {tuple(scale.shape)}")
            self.moe_quant_config = None
            self.moe_kernel = None

        def get_fused_moe_quant_config(self, layer):
            return None  # no modular kernel behind this method

        def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
            if shared_experts is not None:
                raise NotImplementedError("PortableFp8MoEMethod: shared experts are not supported")
            if moe_gather.takes_gathered_path(x.shape[0], self.gather_limit):
                return self._gathered(layer, x, topk_weights, topk_ids)
            return fp8_experts_forward(x, layer.w13_weight, layer.w13_weight_scale, layer.w2_weight,
                                       layer.w2_weight_scale, topk_weights, topk_ids, layer.expert_map,
                                       self.quant_per_token)

        def _gathered(self, layer, x, topk_weights, topk_ids):
            local_ids = moe_gather.local_ids_from_map(topk_ids, layer.expert_map)  # [T, k]
            if x.shape[0] not in self.gathered_sizes_logged:
                self.gathered_sizes_logged.add(x.shape[0])
                count = moe_gather.gathered_count(x.shape[0], local_ids.shape[-1], layer.w13_weight.shape[0])
                logger.info("portable FP8 experts %s: gathered path for %d tokens (%d of %d local experts, "
                            "BEAM_MOE_GATHER=%d)", getattr(layer, "layer_name", "?"), x.shape[0], count,
                            layer.w13_weight.shape[0], self.gather_limit)
            return moe_gather.gathered_fp8_moe(x, layer.w13_weight, layer.w13_weight_scale, layer.w2_weight,
                                               layer.w2_weight_scale, topk_weights, local_ids, self.quant_per_token)

        @property
        def supports_eplb(self) -> bool:
            return False

    return PortableFp8MoEMethod, CompressedTensorsW8A8Fp8MoEMethod


def portable_replacement(method, layer, layer_name):
    """The PortableFp8MoEMethod to use instead of vLLM's `method`, or None to keep vLLM's.

    Taken exactly where vLLM's W8A8 FP8 MoE method found no backend (NONE) for the published
    scheme (channel weights, dynamic per-token activations) while vLLM builds a Beam model.
    """
    from compressed_tensors.quantization import QuantizationStrategy
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend

    from beam_hpu.scope import building_beam

    portable_cls, stock_cls = _method_class()
    if (building_beam() and type(method) is stock_cls and method.fp8_backend == Fp8MoeBackend.NONE
            and method.weight_quant.strategy == QuantizationStrategy.CHANNEL
            and method.input_quant.strategy == QuantizationStrategy.TOKEN and method.input_quant.dynamic):
        return portable_cls(method.weight_quant, method.input_quant, layer.moe_config, layer_name)
    return None
