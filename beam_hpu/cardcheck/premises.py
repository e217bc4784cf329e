"""The measurements behind each verdict, at Beam's real shapes on a card (quick: small shapes, for
CPU). Each returns a Verdict from beam_hpu.cardcheck.verdicts; on CPU the Habana ops are the
project's own CPU paths (the dense FP8 pass for the fused MoE op, torch SDPA for FusedSDPA, the
Gaudi-mode cast for cast_to_fp8_v2), so the figures only show the command works."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from beam_hpu.cardcheck import verdicts
from beam_hpu.cardcheck.device import Device
from beam_hpu.model.dflash2_sizes import DFlash2Sizes
from beam_hpu.quant.rounding import GAUDI2_FP8_MAX, fp32_product_cast_to_fp8, gaudi_cast_to_fp8, per_token_fp8

# Beam-1.0-501B-A23B at the recipe's TP 8 / EP 8 (beam_hpu/model/config.py's published values).
HIDDEN, MOE_INTERMEDIATE, EXPERTS, TOP_K = 5120, 2560, 256, 8
LOCAL_EXPERTS = EXPERTS // 8
Q_HEADS_PER_CARD, HEAD_DIM, CHUNK = 48 // 8, 128, 4096
# The recipe's launch values of BEAM_FSDPA_Q_TILE and BEAM_FSDPA_WS_GIB (serving/recipe.yaml), used
# when this process does not set them.
RECIPE_Q_TILE, RECIPE_WS_GIB = 256, 2.0


LAYERS, KV_HEADS_PER_CARD, VOCAB = 52, 1, 151936
# Rows of one sequence's verify step: the bonus token and up to 7 drafted ones (DFlash2's serving
# block of 8).
VERIFY_ROWS = tuple(range(1, 9))


@dataclass
class Shapes:
    hidden: int
    intermediate: int
    chunk: int
    head_dim: int
    contexts: tuple[int, ...]
    vocab: int
    repeats: int
    layers: int  # layers of the target's stand-in step (verify_rows)
    decode_context: int  # tokens of KV one sequence's verify rows attend to


@dataclass(frozen=True)
class DrafterShapes(DFlash2Sizes):
    """The DFlash2 drafter whole (not per card), at the batches its step is timed at."""

    batches: tuple[int, ...] = (1, 4, 16)

    def per_card_config(self, tp: int = 8):
        """The drafter config of one card's shard at TP `tp`, for a one-rank build: heads, SwiGLU
        and the LM head's vocabulary divided by tp, replicated layers (fc, convs, selector) whole;
        the selector's codebooks take the shard's vocabulary (its candidates are the shard's)."""
        return SimpleNamespace(
            architectures=["DFlash2BeamDraftModel"], num_hidden_layers=self.layers, hidden_size=self.hidden,
            intermediate_size=self.intermediate // tp, num_attention_heads=self.q_heads // tp,
            num_key_value_heads=max(1, self.kv_heads // tp), head_dim=self.head_dim, rms_norm_eps=1e-6,
            vocab_size=self.vocab // tp, max_position_embeddings=2 * self.window + 2 * self.block,
            sliding_window=self.window, layer_types=["sliding_attention"] * self.layers, is_causal=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            dflash_config={"target_layer_ids": list(self.target_layer_ids), "conv_kernel_size": self.taps,
                           "conv_group_size": self.conv_group, "selector_rank": self.rank,
                           "selector_top_k": self.top_k, "final_logit_softcapping": 30.0,
                           "mask_token_id": self.vocab // tp - 1})


FULL = Shapes(HIDDEN, MOE_INTERMEDIATE, CHUNK, HEAD_DIM, (4096, 16384, 65536), VOCAB, 10, LAYERS, 1024)
QUICK = Shapes(128, 64, 256, 32, (256, 1024, 4096), 512, 3, 2, 256)
FULL_DRAFTER = DrafterShapes()
QUICK_DRAFTER = DrafterShapes(layers=2, hidden=128, q_heads=16, kv_heads=8, head_dim=32, intermediate=512,
                              window=256, taps=2, conv_group=16, rank=16, top_k=8, vocab=512 * 8, batches=(1, 4))


def _fp8(shape, generator, device):
    return (torch.randn(*shape, generator=generator) * 60).clamp(-240, 240).to(torch.float8_e4m3fn).to(device)


def fp8_steps_apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| in units of the e4m3 step at |b| (elements above 1e-3 of b's largest)."""
    a, b = a.float().cpu(), b.float().cpu()
    keep = b.abs() > 1e-3 * b.abs().max().clamp_min(1e-30)
    if not bool(keep.any()):
        return 0.0
    step = torch.exp2(torch.floor(torch.log2(b[keep].abs())) - 3)
    return float(((a[keep] - b[keep]).abs() / step).max())


def _routing(routed: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk ids [T, 8] as global ids, weights [T, 8]): `routed` distinct local experts (ids below
    LOCAL_EXPERTS) routed over ceil(routed / 8) tokens, the rest on other cards."""
    tokens = max(1, -(-routed // TOP_K))
    ids = torch.full((tokens, TOP_K), LOCAL_EXPERTS, dtype=torch.int64)  # other cards' experts
    for n in range(routed):
        ids[n // TOP_K, n % TOP_K] = n
    others = torch.arange(LOCAL_EXPERTS + 1, LOCAL_EXPERTS + 1 + ids.numel()).reshape(ids.shape)
    ids = torch.where(ids == LOCAL_EXPERTS, others % (EXPERTS - LOCAL_EXPERTS) + LOCAL_EXPERTS, ids)
    weights = torch.rand(ids.shape, generator=generator).softmax(-1)
    return ids, weights


def server_fused_moe(x, ids, weights, w13, w13s, w2, w2s, quantise):
    """The fused FP8 MoE op as vllm-gaudi's VllmMixtureOfExpertsOpFP8PerChannel calls it: the
    activations quantised per token, each local expert's weights and its squeezed per-channel scales
    ([2I] and [H]) as lists, permuted weights, SiLU, every local expert. w13 [E, 2I, H], w13s
    [E, 2I, 1], w2 [E, H, I], w2s [E, H, 1]; x [T, H] -> [T, H]."""
    x_fp8, x_scale = quantise(x)
    return torch.ops.hpu.mixture_of_experts.fp8_fused_weights_dynamic(
        hidden_states=x_fp8, expert_routing_table=ids, router_weights=weights,
        w12=list(w13.unbind(0)), w3=list(w2.unbind(0)), d_scale_hidden_states=x_scale,
        d_scale_w12=list(w13s.squeeze(-1).unbind(0)), d_scale_w3=list(w2s.squeeze(-1).unbind(0)),
        permuted_weights=True, activation="silu", experts_min=0, experts_max=w13.shape[0] - 1)


def moe(device: Device, shapes: Shapes) -> verdicts.Verdict:
    from beam_hpu.runtime.fp8.hpu_moe_gather import (cpu_fp8_gemm, dense_fp8_moe, gathered_fp8_moe,
                                                     hpu_fp8_gemm, local_ids_from_offset)

    g = torch.Generator().manual_seed(0)
    H, I, E = shapes.hidden, shapes.intermediate, LOCAL_EXPERTS
    w13, w2 = _fp8((E, 2 * I, H), g, device.name), _fp8((E, H, I), g, device.name)
    w13s = (torch.rand(E, 2 * I, 1, generator=g) / 50 + 1e-3).to(device.name)
    w2s = (torch.rand(E, H, 1, generator=g) / 50 + 1e-3).to(device.name)

    def quantise(t):
        return per_token_fp8(t, GAUDI2_FP8_MAX, exact=False)

    gemm = hpu_fp8_gemm if device.on_card else cpu_fp8_gemm
    fused_ms, gathered_ms, apart = {}, {}, 0.0
    for routed in (1, 8, 32):
        ids, weights = _routing(routed, g)
        x = (torch.randn(ids.shape[0], H, generator=g) * 3).to(torch.bfloat16).to(device.name)
        ids, weights = ids.to(device.name), weights.to(torch.bfloat16).to(device.name)
        local = local_ids_from_offset(ids, 0, E)
        if device.on_card:
            def fused():
                return server_fused_moe(x, ids, weights, w13, w13s, w2, w2s, quantise)
        else:  # the fused op's CPU stand-in: the dense pass over every local expert
            def fused():
                return dense_fp8_moe(x, w13, w13s, w2, w2s, weights, local, quantise, gemm)

        def gathered():
            return gathered_fp8_moe(x, w13, w13s, w2, w2s, weights, local, quantise, gemm)

        fused_ms[routed] = device.median_ms(fused, shapes.repeats)
        gathered_ms[routed] = device.median_ms(gathered, shapes.repeats)
        apart = max(apart, fp8_steps_apart(gathered(), fused()))
    return verdicts.moe_gather(fused_ms, gathered_ms, apart)


def cast(device: Device, shapes: Shapes) -> verdicts.Verdict:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, shapes.hidden, generator=g) * 2).to(torch.bfloat16)
    inv = (GAUDI2_FP8_MAX / (x.abs().amax(-1, keepdim=True) + 1e-8)).to(torch.bfloat16)
    if device.on_card:
        got = torch.ops.hpu.cast_to_fp8_v2(x.to("hpu"), inv.to("hpu"), False, False, torch.float8_e4m3fn)[0].cpu()
    else:  # the stand-in is the Gaudi-mode model itself
        got = gaudi_cast_to_fp8(x, inv, GAUDI2_FP8_MAX)
    bits = got.view(torch.uint8)
    same_as = {name: float((bits == model(x, inv, GAUDI2_FP8_MAX).view(torch.uint8)).float().mean())
               for name, model in (("input", gaudi_cast_to_fp8), ("fp32", fp32_product_cast_to_fp8))}
    return verdicts.cast_rounding(same_as["input"], same_as["fp32"])


def storage(device: Device, shapes: Shapes) -> verdicts.Verdict:
    param = torch.nn.Parameter(torch.zeros(64, 64, device=device.name))
    view = param.data[8:16]
    device.sync()
    return verdicts.storage_identity(param.untyped_storage().data_ptr(), view.untyped_storage().data_ptr(),
                                     view.data_ptr() - param.data_ptr())


def fsdpa(device: Device, shapes: Shapes, q_tile: int, ws_gib: float) -> verdicts.Verdict:
    from beam_hpu.runtime.prefill.hpu_fsdpa_tiles import prefill_attention, sdpa_kernel, tile_rows

    scale = 1 / math.sqrt(shapes.head_dim)
    if device.on_card:
        import habana_frameworks.torch.core as htcore

        kernel = server_fsdpa(scale)
        between = htcore.mark_step
    else:
        kernel, between = sdpa_kernel(scale), None
    g = torch.Generator().manual_seed(2)
    by_context = {}
    for ctx in shapes.contexts:
        keys = ctx + shapes.chunk
        q = torch.randn(1, Q_HEADS_PER_CARD, shapes.chunk, shapes.head_dim, generator=g).to(torch.bfloat16)
        k = torch.randn(1, Q_HEADS_PER_CARD, keys, shapes.head_dim, generator=g).to(torch.bfloat16)
        v = torch.randn(1, Q_HEADS_PER_CARD, keys, shapes.head_dim, generator=g).to(torch.bfloat16)
        causal = torch.ones(shapes.chunk, keys, dtype=torch.bool).tril(ctx)
        bias = torch.zeros(1, 1, shapes.chunk, keys).masked_fill(~causal, float("-inf")).to(torch.bfloat16)
        q, k, v, bias = (t.to(device.name) for t in (q, k, v, bias))
        rows = tile_rows(shapes.chunk, keys, batch=1, q_heads=Q_HEADS_PER_CARD, q_tile=q_tile, ws_gib=ws_gib)
        try:
            untiled = device.median_ms(lambda: kernel(q, k, v, bias), shapes.repeats)
        except RuntimeError:  # the single call does not fit the device
            untiled = None
        tiled = device.median_ms(lambda: prefill_attention(q, k, v, bias, kernel, q_tile=q_tile, ws_gib=ws_gib,
                                                           between_tiles=between), shapes.repeats)
        by_context[ctx] = {"untiled_ms": untiled, "tiled_ms": tiled, "calls": -(-shapes.chunk // min(rows, shapes.chunk))}
    return verdicts.fsdpa_tiles(by_context)


def verify(device: Device, shapes: Shapes, batch: int = 4, max_drafts: int = 7, steps: int = 20) -> verdicts.Verdict:
    """The Gaudi verify step with sampled rows (hpu_sampled_verify.verify_drafts) in vllm-gaudi's
    padded layout of `max_drafts` slots a sequence, over random draft counts 0..max_drafts: one
    greedy row (-1.0, vllm-gaudi's), the others at Beam's recommended temperature 0.7 / top_p 0.99,
    the last seeded, always with drafts (its uniforms and noise row drawn by a host generator, the
    row copied in: a step without seeded drafts leaves that copy out, which is not what is timed)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from beam_hpu.runtime.speculative.hpu_sampled_verify import verify_drafts

    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    width = max_drafts + 1
    temperature = [-1.0] + [0.7] * (batch - 1)

    def step(counts):
        target = torch.tensor([b * width + i if i < n else -1 for b, n in enumerate(counts) for i in range(max_drafts)],
                              dtype=torch.int32)
        cu = torch.tensor(counts).cumsum(0).to(torch.int32)
        metadata = SpecDecodeMetadata(
            draft_token_ids=torch.randint(0, shapes.vocab, (batch * max_drafts,), generator=g).to(device.name),
            num_draft_tokens=counts, cu_num_draft_tokens=cu.to(device.name),
            cu_num_sampled_tokens=(cu + torch.arange(1, batch + 1)).to(device.name),
            target_logits_indices=target.to(device.name),
            bonus_logits_indices=torch.tensor([b * width + n for b, n in enumerate(counts)]).to(device.name),
            logits_indices=torch.arange(batch * width))
        seeded = {batch - 1: torch.Generator().manual_seed(rng.randrange(1 << 30))}
        rows = SamplingMetadata(
            temperature=torch.tensor(temperature).to(device.name), all_greedy=False, all_random=False,
            top_p=torch.full((batch,), 0.99).to(device.name), top_k=None, generators=seeded,
            max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=None,
            presence_penalties=None, repetition_penalties=None, output_token_ids=[[] for _ in range(batch)],
            allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
        logits = torch.randn(batch * width, shapes.vocab, generator=g).to(torch.bfloat16).to(device.name)
        bonus = torch.randint(0, shapes.vocab, (batch, 1), generator=g).to(device.name)
        return lambda: verify_drafts(metadata, logits, rows, bonus)

    # Lazy mode without HPU graphs: the figure is the bridge's compile count over draft counts, which
    # a capture of each call's own graph would add to.
    device.median_ms(step([max_drafts] * batch), 1, graph=False)  # warm-up: the one graph of (batch, max_drafts)
    before = device.graph_compilations()
    ms = {}
    for _ in range(steps):
        counts = [rng.randint(0, max_drafts) for _ in range(batch - 1)] + [rng.randint(1, max_drafts)]
        ms[sum(counts)] = device.median_ms(step(counts), 1, warmup=0, graph=False)
    after = device.graph_compilations()
    return verdicts.verify_step(None if before is None or after is None else after - before, ms)


def server_fsdpa(scale: float):
    """FusedSDPA called as vllm-gaudi's _fsdpa_prompt_attention calls it under the recipe's
    environment (VLLM_FP32_SOFTMAX: softmax_mode "fp32"; recompute_mode on; the mask given, no valid
    lengths; right padding): (q, k, v, bias) -> out."""
    from habana_frameworks.torch.hpex.kernels import FusedSDPA

    return lambda q, k, v, b: FusedSDPA.apply(q, k, v, b, 0.0, False, scale, "fp32", True, None, "right")


def _attention_kernel(device: Device, scale: float):
    if device.on_card:
        return server_fsdpa(scale)
    from beam_hpu.runtime.prefill.hpu_fsdpa_tiles import sdpa_kernel

    return sdpa_kernel(scale)


def verify_rows(device: Device, shapes: Shapes, rows=VERIFY_ROWS) -> verdicts.Verdict:
    """What stands for the target's step at T = 1..8 rows of one sequence (card-check has no target
    model): `shapes.layers` times one Beam layer at its per-card shapes under TP 8 / EP 8, its
    weights reused by every layer: FP8 q/gate/k/v and o projections, attention of the T rows over
    `decode_context` cached keys (FusedSDPA; CPU: torch SDPA), the fp32 router's top-8 of 256 and
    the fused MoE op over the card's 32 experts (CPU: the dense FP8 pass). Not in it: norms, RoPE,
    the two all-reduces a layer, the LM head, sampling, the runner's input builds."""
    from beam_hpu.runtime.fp8.hpu_moe_gather import cpu_fp8_gemm, dense_fp8_moe, hpu_fp8_gemm, local_ids_from_offset

    g = torch.Generator().manual_seed(4)
    H, I, E, D = shapes.hidden, shapes.intermediate, LOCAL_EXPERTS, shapes.head_dim
    qh, kvh, ctx = Q_HEADS_PER_CARD, KV_HEADS_PER_CARD, shapes.decode_context
    gemm = hpu_fp8_gemm if device.on_card else cpu_fp8_gemm

    def scales(n):
        return (torch.rand(n, 1, generator=g) / 50 + 1e-3).to(device.name)

    w_in, w_in_s = _fp8(((2 * qh + 2 * kvh) * D, H), g, device.name), scales((2 * qh + 2 * kvh) * D)
    w_o, w_o_s = _fp8((H, qh * D), g, device.name), scales(H)
    router = (torch.randn(EXPERTS, H, generator=g) / H**0.5).to(device.name)
    w13, w2 = _fp8((E, 2 * I, H), g, device.name), _fp8((E, H, I), g, device.name)
    w13s = (torch.rand(E, 2 * I, 1, generator=g) / 50 + 1e-3).to(device.name)
    w2s = (torch.rand(E, H, 1, generator=g) / 50 + 1e-3).to(device.name)
    cache_k = torch.randn(1, kvh, ctx, D, generator=g).to(torch.bfloat16).to(device.name)
    cache_v = torch.randn(1, kvh, ctx, D, generator=g).to(torch.bfloat16).to(device.name)
    kernel = _attention_kernel(device, 1 / math.sqrt(D))

    def quantise(t):
        return per_token_fp8(t, GAUDI2_FP8_MAX, exact=False)

    def layer(x, bias):
        T = x.shape[0]
        proj = gemm(*quantise(x), w_in, w_in_s).to(torch.bfloat16)  # [T, (2 qh + 2 kvh) D]
        q, gate, k, v = proj.split([qh * D, qh * D, kvh * D, kvh * D], dim=-1)
        keys = torch.cat([cache_k, k.view(T, kvh, D).transpose(0, 1)[None]], dim=2)
        values = torch.cat([cache_v, v.view(T, kvh, D).transpose(0, 1)[None]], dim=2)
        if device.on_card:  # FusedSDPA takes as many KV heads as query heads
            keys, values = (t.repeat_interleave(qh // kvh, dim=1) for t in (keys, values))
        out = kernel(q.view(T, qh, D).transpose(0, 1)[None], keys, values, bias)  # [1, qh, T, D]
        out = out[0].transpose(0, 1).reshape(T, qh * D) * torch.sigmoid(gate)
        x = x + gemm(*quantise(out), w_o, w_o_s).to(torch.bfloat16)
        weights, ids = (x.float() @ router.t()).topk(TOP_K, dim=-1)
        local = local_ids_from_offset(ids, 0, E)
        weights = weights.softmax(-1).to(torch.bfloat16)
        if device.on_card:
            moe = server_fused_moe(x, ids, weights, w13, w13s, w2, w2s, quantise)
        else:
            moe = dense_fp8_moe(x, w13, w13s, w2, w2s, weights, local, quantise, gemm)
        return x + moe

    ms = {}
    with torch.inference_mode():
        for T in rows:
            x0 = (torch.randn(T, H, generator=g)).to(torch.bfloat16).to(device.name)
            seen = torch.ones(T, ctx + T, dtype=torch.bool).tril(ctx)
            bias = torch.zeros(1, 1, T, ctx + T).masked_fill(~seen, float("-inf")).to(torch.bfloat16).to(device.name)

            def step(x0=x0, bias=bias):
                x = x0
                for _ in range(shapes.layers):
                    x = layer(x, bias)
                return x

            ms[T] = device.median_ms(step, shapes.repeats)
    stand_in = (f"{shapes.layers} x one Beam layer's attention + MoE at TP 8 / EP 8 (weights reused), "
                f"{ctx} tokens of context; no norms, RoPE, all-reduces, LM head or sampling")
    return verdicts.verify_rows(ms, stand_in)


_ONE_RANK = []


def _one_rank(device: Device) -> None:
    """vLLM's parallel state for this one process (the drafter's linears ask for the TP size):
    one card's shard is built as TP 1 at that shard's shapes."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if _ONE_RANK or model_parallel_is_initialized():
        return
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="hccl" if device.on_card else "gloo",
                                     distributed_init_method=f"file://{Path(d) / 'rendezvous'}")
        initialize_model_parallel(1, 1)
    _ONE_RANK.append(True)


def dflash2_block(device: Device, shapes: Shapes, drafter: DrafterShapes, tp: int = 8) -> verdicts.Verdict:
    """DFlash2's step on one card: the port proposer's captured step
    (beam_hpu.runtime.speculative.hpu_dflash2_proposer.DFlash2Step) over beam_hpu.model.dflash2's
    DFlash2BeamForCausalLM built as one card's TP-8 shard (random bf16 weights), each request's
    ring holding a full window; timed: the context update of 8 accepted rows (fc of the 5 target
    states, the 5 layers' K/V, written into the ring), the block forward at `drafter.block` rows,
    the LM head over the card's vocabulary shard, top-k and the selector's greedy walk. Not in it:
    the TP all-reduces and the all-gather of the candidates, the runner's input builds."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    from beam_hpu.model.dflash2 import DFlash2BeamForCausalLM
    from beam_hpu.runtime.speculative.dflash2_ring import ContextRing
    from beam_hpu.runtime.speculative.hpu_dflash2_proposer import DFlash2Step

    g = torch.Generator().manual_seed(5)
    config = drafter.per_card_config(tp)
    B, C, L = drafter.block, drafter.window, drafter.layers
    Nkv, D, H = config.num_key_value_heads, drafter.head_dim, drafter.hidden
    with set_current_vllm_config(VllmConfig()):
        _one_rank(device)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device.name):
                model = DFlash2BeamForCausalLM(
                    vllm_config=SimpleNamespace(model_config=SimpleNamespace(hf_config=config)))
        finally:
            torch.set_default_dtype(previous)
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 1:
                    param.fill_(1.0)
                else:
                    param.copy_((torch.randn(param.shape, generator=g) / param.shape[-1] ** 0.5).to(param.dtype))
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, QuantizeMethodBase):
                method.process_weights_after_loading(module)
        n_states = len(drafter.target_layer_ids)
        ms = {}
        with torch.inference_mode():
            for R in drafter.batches:
                def put(t):
                    return t.to(device.name)

                # the step the port's proposer captures per batch bucket, each request's window full
                ring = ContextRing(L, R, C, Nkv, D, torch.bfloat16, device.name)
                ring.keys.copy_(put(torch.randn(ring.keys.shape, generator=g).to(torch.bfloat16)))
                ring.values.copy_(put(torch.randn(ring.values.shape, generator=g).to(torch.bfloat16)))
                ring.positions[:R] = put(torch.arange(C).repeat(R, 1))
                drafting = DFlash2Step(model, ring, B, max_model_len=config.max_position_embeddings)
                aux = put((torch.randn(R * B, n_states * H, generator=g)).to(torch.bfloat16))
                positions = put(torch.arange(C, C + B).repeat(R, 1))  # the 8 rows last accepted
                valid = put(torch.ones(R, B, dtype=torch.bool))
                slots = put(torch.arange(R))
                bonus = put(torch.zeros(R, dtype=torch.long))

                def step(aux=aux, positions=positions, valid=valid, slots=slots, bonus=bonus, drafting=drafting):
                    return drafting(aux, positions, valid, slots, bonus)

                ms[R] = device.median_ms(step, shapes.repeats)
    shard = (f"one card's TP {tp} shard: {config.num_attention_heads} q / {Nkv} KV heads of {D}, SwiGLU "
             f"{config.intermediate_size}, vocabulary shard {config.vocab_size}; {L} layers, hidden {H}, "
             f"block {B}, {C} context slots a request")
    return verdicts.dflash2_block(ms, shard)


def window_kv(device: Device, shapes: Shapes, decode_step_ms: float | None, batches=(1, 8, 32)) -> verdicts.Verdict:
    from types import SimpleNamespace

    from beam_hpu.runtime.window_kv.hpu_steps import StepGroups, combine_step_inputs

    names = tuple(tuple(f"layer{g}.{j}" for j in range(9)) for g in range(6))
    groups = StepGroups(names, (512,) * 5 + (None,))
    build_ms = {}
    for batch in batches:
        tokens = torch.arange(batch)

        def outs():
            return [SimpleNamespace(num=batch, token_ids=tokens, attn_metadata=SimpleNamespace(
                block_list=torch.zeros(batch * 8, dtype=torch.int32, device=device.name),
                slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device.name))) for _ in range(6)]

        built = [outs() for _ in range(shapes.repeats + 2)]
        # host work on other inputs at each repeat: nothing to capture
        build_ms[batch] = device.median_ms(lambda: combine_step_inputs(built.pop(), groups), shapes.repeats,
                                           graph=False)
    return verdicts.window_kv_build(build_ms, decode_step_ms)
