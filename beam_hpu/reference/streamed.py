"""The stored perplexity reference (`beam-gates-reference/1`) for a checkpoint no host can hold:
`beam_hpu.reference.in_memory`'s per-token FP8 reference computed one layer at a time. The command
that runs it is `beam-hpu reference` (`beam_hpu.gates.stored_reference`: it picks the gate profile).

Passages FILE: a JSON object, passage name -> token ids, or -> {"token_ids": [...], "scored": [...]}
(`scored` as in the reference format); or text files, one passage each. The run:
  1. checks everything it can before reading a weight: the config, every shard header, that every
     tensor of every layer is there with the shape the model needs, the FP8 config against the
     tensors, token ids inside the vocabulary, the passages' lengths and flags;
  2. embeds the passages (only the embedding rows they use are read);
  3. per layer: reads that layer's tensors (the project's checkpoint reader: header table, preadv
     of byte runs, no mmap), runs both streams (the reference and its top-1 floor model, see
     `layer_stream.Stream`) of every passage through it, frees it, saves the hidden states to the
     workdir (`reference_workdir`), logs time, bytes and an ETA on `vllm.beam_hpu.reference`;
  4. final norm and LM head in vocabulary slices (log-sum-exp, top-k and the tokens' logits merged
     over slices), and writes the file the perplexity gate reads.
Memory: one layer's tensors (an MoE layer: its attention and router, and two groups of experts of
`layer_stream.EXPERT_GROUP_BYTES` raw each, dequantised one expert at a time) plus the passages'
activations: per stream, a few copies of [tokens, hidden] and one attention score matrix.
A run that stops (killed, or `--stop-after-layer`) is resumed by the same command: it continues
after the newest layer file that checks out.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch

from beam_hpu.loader.options import LoaderOptions
from beam_hpu.loader.reader import RangeReader
from beam_hpu.quant.fp8_dequant import dequantise_rows
from beam_hpu.reference import kv_fp8
from beam_hpu.reference import layer_stream as ls
from beam_hpu.reference.file_format import FORMAT, gates_of, scored_positions
from beam_hpu.reference.in_memory import FP8_E4M3FN_MAX, set_activation_quant
from beam_hpu.reference.plan import WITHOUT_KV_FP8, Passage, Plan, make_plan
from beam_hpu.reference.workdir import Workdir

logger = logging.getLogger("vllm.beam_hpu.reference")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# fp32 LM-head rows per vocabulary slice, in bytes.
VOCAB_SLICE_BYTES = 256 << 20


def _dequantised(plan: Plan, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every FP8 weight (a `.weight` with its `.weight_scale`) dequantised as compressed-tensors'
    dequantiser does it for beam_hpu.reference.in_memory (`fp8_dequant`: the same bits, faster);
    the rest as it is."""
    if not plan.fp8:
        return raw
    out = {n: t for n, t in raw.items() if not n.endswith(".weight_scale")}
    for scale_name in (n for n in raw if n.endswith(".weight_scale")):
        name = scale_name.removesuffix("_scale")
        out[name] = dequantise_rows([(raw[name], raw[scale_name])], plan.dequantizer.dtype)
    return out


class Contexts:
    """Per stream and passage: position ids, and per layer type the mask, rotary embedding and
    attention scaling, made by transformers' own functions as `BeamModel.forward` makes them."""

    def __init__(self, plan: Plan):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
        from transformers.models.beam.modeling_beam import BeamRotaryEmbedding, compute_attention_scaling

        config = plan.config
        rotary = BeamRotaryEmbedding(config)
        self.by = {}
        for s in plan.streams:
            for j, p in enumerate(plan.passages):
                embeds = torch.empty((1, len(p.ids), config.hidden_size), dtype=s.dtype)
                pos = torch.arange(len(p.ids))[None]
                kw = dict(config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=pos)
                ctx = {"position_ids": pos}
                for kind in set(config.layer_types):
                    mask = create_causal_mask(**kw) if kind == "full_attention" else create_sliding_window_causal_mask(**kw)
                    if config.rope_parameters[kind] is None:
                        ctx[kind] = (mask, None, compute_attention_scaling(pos))
                    else:
                        ctx[kind] = (mask, rotary(embeds, pos, kind), None)
                self.by[s.name, j] = ctx

    def layer_kwargs(self, stream: str, j: int, kind: str) -> dict:
        ctx = self.by[stream, j]
        mask, pe, scaling = ctx[kind]
        return dict(attention_mask=mask, position_embeddings=pe, attention_scaling=scaling,
                    position_ids=ctx["position_ids"], cache=None, use_cache=False)


def _embed(plan: Plan, reader: RangeReader) -> dict[str, torch.Tensor]:
    entry = plan.checkpoint.tensors["model.embed_tokens.weight"]
    used = sorted({t for p in plan.passages for t in p.ids})
    rows = ls.read_rows(reader, entry, used)
    where = {t: k for k, t in enumerate(used)}
    return {f"{s.name}/{j}": rows[[where[t] for t in p.ids]].to(s.dtype)[None]
            for s in plan.streams for j, p in enumerate(plan.passages)}


@torch.no_grad()
def run_layer(plan: Plan, i: int, states: dict[str, torch.Tensor], contexts: Contexts, reader: RangeReader) -> None:
    """Layer `i` of every stream and passage; `states` (stream/passage -> [1, T, H]) updated in place."""
    from transformers.models.beam.modeling_beam import depth_scaled_residual_add

    kind = plan.config.layer_types[i]
    tensors = _dequantised(plan, ls.read_tensors(reader, plan.layer_entries(i)))
    layers = {dtype: sk.model.layers[i] for dtype, sk in plan.skeletons.items()}
    for dtype, layer in layers.items():
        ls.fill(layer, f"model.layers.{i}.", tensors, dtype)
    del tensors
    try:
        routed = []
        for s in plan.streams:
            layer = layers[s.dtype]
            set_quant(plan, s)
            for j in range(len(plan.passages)):
                key, kw = f"{s.name}/{j}", contexts.layer_kwargs(s.name, j, kind)
                if not plan.is_moe(i):
                    states[key] = layer(states[key], **kw)
                    continue
                # BeamDecoderLayer.forward up to the experts
                h = states[key]
                x, _ = layer.self_attn(hidden_states=layer.input_layernorm(h), **kw)
                h = depth_scaled_residual_add(layer.post_attention_layernorm(x), h, layer.attn_residual_add_idx)
                states[key] = h
                x = layer.pre_feedforward_layernorm(h).view(-1, plan.config.hidden_size)
                _, weights, index = layer.mlp.gate(x)
                out = torch.zeros(x.shape, dtype=torch.float32 if s.fp8_experts else x.dtype)
                routed.append((key, ls.Routed(s, layer.mlp.experts, x, index, weights, out,
                                              lambda s=s: set_quant(plan, s))))
        if routed:
            hit = sorted(set(torch.cat([r.index.unique() for _, r in routed]).tolist()))
            ls.stream_experts(reader, hit, lambda e: plan.expert_entries(i, e),
                              lambda raw, e, dtype: _expert_weights(plan, raw, i, e, dtype),
                              [r for _, r in routed])
            for key, r in routed:  # BeamMoE.forward's scaling, then BeamDecoderLayer.forward's end
                layer = layers[r.stream.dtype]
                h = states[key]
                y = (r.result() * layer.mlp.routed_scaling_factor).reshape(h.shape)
                states[key] = depth_scaled_residual_add(layer.post_feedforward_layernorm(y), h,
                                                        layer.mlp_residual_add_idx)
    finally:
        for layer in layers.values():
            ls.empty(layer)


def set_quant(plan: Plan, stream: ls.Stream) -> None:
    model = plan.skeletons[stream.dtype]
    if plan.fp8:
        set_activation_quant(model, stream.fp8_max, plan.exact)
    # FP8 KV: the same range as the activations' (448 on CPU, 240 on Gaudi 2: one server, one range)
    kv_fp8.set_kv_rounding(model, plan.kv_scales if stream.kv_fp8 else None, stream.fp8_max, plan.exact)


def _expert_weights(plan: Plan, raw: dict, i: int, e: int, dtype: torch.dtype):
    p = f"model.layers.{i}.mlp.experts.{e}"
    # transformers' fused layout: gate_up_proj[e] = [gate; up] (BeamExperts._apply_gate chunks it so)
    if plan.fp8:  # compressed-tensors' arithmetic, bit for bit, at a fraction of its time (fp8_dequant)
        w = {proj: (raw[f"{p}.{proj}.weight"], raw[f"{p}.{proj}.weight_scale"]) for proj in ls.EXPERT_PROJECTIONS}
        return (dequantise_rows([w["gate_proj"], w["up_proj"]], plan.dequantizer.dtype).to(dtype),
                dequantise_rows([w["down_proj"]], plan.dequantizer.dtype).to(dtype))
    gate, up, down = (raw[f"{p}.{proj}.weight"].to(dtype) for proj in ls.EXPERT_PROJECTIONS)
    return torch.cat([gate, up]), down


@torch.no_grad()
def head(plan: Plan, states: dict[str, torch.Tensor], reader: RangeReader, k: int,
         kl_pairs: list[tuple[str, str]] = ()) -> dict:
    """Final norm, LM head in vocabulary slices, soft-cap and log-softmax as BeamForCausalLM and
    `beam_hpu.reference.in_memory.next_token_logprobs` compute them; per stream and passage: the token's
    logprob, top-k, and top-1 at every position. `kl_pairs` (a, b): also "kl/b" under a's entry,
    KL(p_a || p_b) over the whole vocabulary at every position."""
    from transformers.models.beam.modeling_beam import BeamRMSNorm

    cfg = plan.config
    t = plan.checkpoint.tensors
    entry = t["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    normed = {}
    for s in plan.streams:
        norm = BeamRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norm.weight = torch.nn.Parameter(ls.read_tensors(reader, [t["model.norm.weight"]])["model.norm.weight"].to(s.dtype),
                                         requires_grad=False)
        for j in range(len(plan.passages)):
            normed[s.name, j] = norm(states[f"{s.name}/{j}"])[0]
    targets = {j: torch.tensor(p.ids[1:] + [0]) for j, p in enumerate(plan.passages)}
    acc = {key: {"lse": [], "top_v": [], "top_i": [], "tok": torch.full((len(x),), float("nan"))}
           for key, x in normed.items()}
    # Per slice s: lse_s of a's logits and E_{softmax_s(a)}[l_a - l_b]; merged below into
    # E_{p_a}[l_a - l_b] = sum_s exp(lse_s - lse_a) * E_s, and KL = that - lse_a + lse_b.
    kl_acc = {(a, b, j): {"lse": [], "mean": []} for a, b in kl_pairs for j in range(len(plan.passages))}
    rows = max(1, VOCAB_SLICE_BYTES // (cfg.hidden_size * 4))
    for v0 in range(0, cfg.vocab_size, rows):
        v1 = min(cfg.vocab_size, v0 + rows)
        w = ls.read_rows(reader, entry, range(v0, v1))
        slice_logits = {}
        for (name, j), x in normed.items():
            dtype = next(s.dtype for s in plan.streams if s.name == name)
            logits = torch.nn.functional.linear(x, w.to(dtype))
            if cfg.final_logit_softcapping is not None:
                logits = torch.tanh(logits.float() / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
            logits = logits.float()
            if kl_pairs:
                slice_logits[name, j] = logits
            a = acc[name, j]
            a["lse"].append(torch.logsumexp(logits, dim=-1))
            v, ix = logits.topk(min(k, v1 - v0), dim=-1)
            a["top_v"].append(v)
            a["top_i"].append(ix + v0)
            inside = (targets[j] >= v0) & (targets[j] < v1)
            a["tok"][inside] = logits[inside.nonzero()[:, 0], targets[j][inside] - v0]
        for (na, nb, j), kl in kl_acc.items():
            la, lb = slice_logits[na, j], slice_logits[nb, j]
            kl["lse"].append(torch.logsumexp(la, dim=-1))
            kl["mean"].append((torch.softmax(la, dim=-1) * (la - lb)).sum(-1))
        del w, slice_logits
    out = {}
    for key, a in acc.items():
        lse = torch.logsumexp(torch.stack(a["lse"]), dim=0)
        v, ix = torch.cat(a["top_v"], dim=-1), torch.cat(a["top_i"], dim=-1)
        # Highest first; among equal logits the lowest token id, as argmax would pick it.
        order = torch.argsort(ix, dim=-1, stable=True)
        v, ix = v.gather(-1, order), ix.gather(-1, order)
        best = torch.argsort(-v, dim=-1, stable=True)[:, :k]
        out[key] = {"lp": a["tok"] - lse, "top_v": v.gather(-1, best) - lse[:, None], "top_i": ix.gather(-1, best),
                    "lse": lse}
    for (na, nb, j), kl in kl_acc.items():
        lse_a, lse_b = out[na, j]["lse"], out[nb, j]["lse"]
        weights = torch.exp(torch.stack(kl["lse"]) - lse_a)  # [slices, T]
        out[na, j][f"kl/{nb}"] = (weights * torch.stack(kl["mean"])).sum(0) - lse_a + lse_b
    return out


def reference_document(plan: Plan, heads: dict, k: int, profile, checkpoint: str | Path) -> dict:
    """The `beam-gates-reference/1` document, as `beam_hpu.reference.live.live_reference` writes it."""
    ref = plan.streams[0]
    dtype_name = {v: n for n, v in DTYPES.items()}[ref.dtype]
    name = (f"per-token FP8 reference (beam_hpu.reference.in_memory, BEAM_EXACT_ROUNDING={int(plan.exact)})" if plan.fp8
            else "transformers Beam")
    if plan.fp8 and ref.fp8_max != FP8_E4M3FN_MAX:
        name += f", fp8_max {ref.fp8_max:g}"
    if plan.kv_scales is not None:
        name += f", FP8 KV cache (scales of {plan.kv_scales.source})"
    passages = []
    for j, p in enumerate(plan.passages):
        r, f = heads["reference", j], heads["floor", j]
        n = len(p.ids)
        doc = {"name": p.name, "token_ids": p.ids,
               "token_logprobs": [None] + [float(x) for x in r["lp"][: n - 1]],
               "top1": [None] + [int(x) for x in r["top_i"][: n - 1, 0]],
               "topk": [None] + [[[int(a), float(b)] for a, b in zip(r["top_i"][i], r["top_v"][i])]
                                 for i in range(n - 1)]}
        if p.scored is not None:
            doc["scored"] = [int(bool(x)) for x in p.scored]
        at = [i - 1 for i in scored_positions(doc)]
        doc["floor_top1"] = float((f["top_i"][at, 0] == r["top_i"][at, 0]).double().mean())
        if plan.kv_scales is not None:
            doc["kv_fp8_cost"] = kv_fp8_cost(r, heads[WITHOUT_KV_FP8, j], at)
        passages.append(doc)
    out = {"format": FORMAT, "model": str(checkpoint), "reference": f"{name}, {dtype_name}", "topk": k,
           "gates": gates_of(profile),
           "passages": passages}
    if plan.kv_scales is not None:
        out["kv_fp8"] = {"scales": plan.kv_scales.source, "fp8_max": ref.fp8_max}
    return out


def kv_fp8_cost(with_kv: dict, without: dict, at: list[int]) -> dict:
    """What FP8 KV costs on one passage's scored positions `at` (row indices): perplexity with over
    without - 1, top-1 agreement, mean KL(without || with) over the whole vocabulary."""
    nll_with, nll_without = -with_kv["lp"][at].double().mean(), -without["lp"][at].double().mean()
    return {"ppl_rel": float(torch.exp(nll_with - nll_without) - 1),
            "top1": float((with_kv["top_i"][at, 0] == without["top_i"][at, 0]).double().mean()),
            "kl": float(without["kl/reference"][at].double().mean())}


def _eta(times: dict[bool, list[float]], remaining: list[bool]) -> float:
    everything = times[True] + times[False]
    if not everything:
        return math.nan
    mean = {kind: (sum(v) / len(v) if v else sum(everything) / len(everything)) for kind, v in times.items()}
    return sum(mean[kind] for kind in remaining)


def stream_layers(plan: Plan, work: Workdir, reader: RangeReader, *, task: str = "reference",
                  stop_after_layer: int | None = None, on_layer=None, prepare=None) -> dict | None:
    """Every decoder layer of every stream and passage, resumed from `work` and saved to it after each
    layer, with progress and an ETA on the log; the states after the last layer, or None when stopped
    by `stop_after_layer`. `prepare(states)` runs once before the first layer computed here (the
    calibration puts its observer on the model; the states then hold what it recorded so far)."""
    n_layers = plan.config.num_hidden_layers
    resumed = work.resume()
    if resumed is None:
        start, states = 0, _embed(plan, reader)
    else:
        start, states = resumed[0] + 1, {n: t for n, t in resumed[1].items()}
        logger.info("resuming %s after layer %d (%s)", plan.checkpoint.directory, resumed[0], work.directory)
    if prepare is not None:
        prepare(states)
    contexts = Contexts(plan)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(start, n_layers):
        t0, b0 = time.perf_counter(), reader.bytes_read
        run_layer(plan, i, states, contexts, reader)
        work.save(i, states)
        dt, nbytes = time.perf_counter() - t0, reader.bytes_read - b0
        times[plan.is_moe(i)].append(dt)
        eta = _eta(times, [plan.is_moe(x) for x in range(i + 1, n_layers)])
        logger.info("%s: layer %d/%d (%s) %.1f s, read %.3f GB (%.2f GB/s); ETA %.1f min", task,
                    i + 1, n_layers, "MoE" if plan.is_moe(i) else "dense", dt, nbytes / 1e9,
                    nbytes / 1e9 / max(dt, 1e-9), eta / 60)
        if on_layer:
            on_layer(i, dt, nbytes)
        if i == stop_after_layer and i + 1 < n_layers:
            logger.info("%s: stopping after layer %d as asked; run again to resume", task, i)
            return None
    return states


def write_streamed_reference(checkpoint: str | Path, passages: list[Passage], out: str | Path, *,
                             dtype: torch.dtype = torch.bfloat16, fp8_max: float | None = None,
                             exact: bool | None = None,
                             profile, workdir: str | Path | None = None, k: int = 20,
                             stop_after_layer: int | None = None, options: LoaderOptions | None = None,
                             on_layer=None, kv_scales=None) -> dict | None:
    """Write the reference file `out`; return its document (None when stopped by `stop_after_layer`:
    the hook that ends a run once that layer is saved, as a kill would, for tests and for splitting
    a run over sessions). `on_layer(i, seconds, bytes_read)` is called after each computed layer.
    `kv_scales` (kv_fp8.KvScales): the reference models an FP8 KV cache with them, and the document
    carries per passage what that costs against the same reference without it (`kv_fp8_cost`)."""
    plan = make_plan(checkpoint, passages, dtype, fp8_max, exact, kv_scales=kv_scales)
    out = Path(out)
    work = Workdir(workdir or out.with_name(out.name + ".work"), plan.description)
    options = options or LoaderOptions()
    with RangeReader(plan.checkpoint.files, options.num_threads, options.chunk_bytes) as reader:
        states = stream_layers(plan, work, reader, stop_after_layer=stop_after_layer, on_layer=on_layer)
        if states is None:
            return None
        t0 = time.perf_counter()
        pairs = [(WITHOUT_KV_FP8, "reference")] if kv_scales is not None else []
        heads = head(plan, states, reader, k, kl_pairs=pairs)
        logger.info("reference: final norm and LM head %.1f s", time.perf_counter() - t0)
    doc = reference_document(plan, heads, k, profile, checkpoint)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc) + "\n")
    tmp.replace(out)
    logger.info("reference: wrote %s (%d passages)", out, len(doc["passages"]))
    return doc
