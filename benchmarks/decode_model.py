"""A step-time MODEL (not a measurement) of Beam-1.0 decode on the recipe's node, with and without
the gathered FP8 MoE path (switch BEAM_MOE_GATHER, port unit beam-moe-gather).

Inputs, all printed: Beam's shapes (BeamConfig's defaults, the published checkpoint's), the
recipe's layout (TP 8 attention and dense layers, EP 8 experts), Gaudi 2's published HBM bandwidth,
and the recipe's two measured decode figures (1 stream 28.5-29.5 tok/s, 16 streams 410 tok/s).
For each batch (1, 2, 4, 8, 16), without and with drafts (k tokens, a mean accepted length), it
counts the bytes one card reads in one step (experts, attention, dense MLPs, router, LM head, KV)
on the stock path and on the gathered path, and predicts tokens/s from

  step(T) = other(T) + bytes(T) / (bandwidth x efficiency)        (the serial model)

where other(T), everything a step costs beyond streaming its bytes (host launches, compute,
collectives), is what the measured steps leave over after their stock bytes: at T = 1 and T = 16,
linear in T between them and beyond (an extrapolation past 16, marked). That other() is the same on
both paths is an assumption too: the gathered path adds 2G GEMM launches and G combine ops per MoE
layer to each graph.

Two premises decide whether any of it holds; the model cannot settle them, a card run can:
- that the fused mixture_of_experts op streams every local expert each step (the issue's reading;
  if the op already skips unrouted experts there is nothing to save);
- that a step's host time and device time add (serial). vLLM-HPU launches graphs asynchronously;
  if the host hides the device time (step = max(host, device)), a step that is host-bound stays
  where it is. The recipe itself says decode is host-launch-bound.
The measurement that confirms or refutes it: single-stream decode tok/s with BEAM_MOE_GATHER=1
against BEAM_MOE_GATHER=0, everything else the recipe's (256-token completions, the Performance
row). This model predicts the figures printed under "the card measurement"; a result within the
run-to-run spread of 29 tok/s refutes the serial, dense-streaming premise.

A second figure, DFlash2 at one stream (Beam's block drafter, 7 drafted tokens a step), is a
model of the same kind: a step emits the mean accepted length L and costs a verify step of 8 rows
plus the drafter's block, both in units of a 1-row decode step, so

  tok/s = one-stream tok/s x L / (verify(8) / verify(1) + block / verify(1))

Its inputs default to the speculative README's plan (verify(8) ~ 1 step, block ~ 0.1 step, L 2.5 /
3.5 / 4); `--card-check FILE` takes the two costs from a `beam-hpu card-check` report instead.

Run: python benchmarks/decode_model.py [--bandwidth-tbs 2.46] [--efficiency 1.0] [--context 1024]
     [--drafts 4] [--accepted 2.0] [--dflash2-verify8 1.0] [--dflash2-block 0.1]
     [--dflash2-accepted 2.5 3.5 4] [--card-check card-check.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from beam_hpu.cardcheck.device import CPU_LABEL  # noqa: E402
from beam_hpu.cardcheck.verdicts import (ASSUMED_BLOCK_SHARE, ASSUMED_VERIFY_8_RATIO,  # noqa: E402
                                         DFLASH2_ACCEPTED_TABLE, dflash2_gain_model)
from beam_hpu.model.config import beam_config_class  # noqa: E402
from beam_hpu.runtime.fp8.hpu_moe_gather import gathered_count  # noqa: E402

CARDS = 8  # TP 8 + --enable-expert-parallel
BLOCK = 128  # --block-size: KV is read in whole blocks
FP8_BYTES, BF16_BYTES, FP32_BYTES = 1, 2, 4
GB = 1e9
# The recipe's Performance rows (the recipe text, ../shared/seeds/gaudi-recipe-beam-fp8.txt beside the clone)
ONE_STREAM_TOK_S = (28.5, 29.5)
SIXTEEN_STREAMS_TOK_S = 410.0
BATCHES = (1, 2, 4, 8, 16)
VARIANT_LIMIT = 1  # BEAM_MOE_GATHER of the opt-in variant (serving/launch-moe-gather.sh; the recipe: 0)


@dataclass(frozen=True)
class Shapes:
    hidden: int
    layers: int
    dense_layers: int
    sliding_layers: int
    window: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dense_inter: int
    moe_inter: int
    experts: int
    top_k: int
    vocab: int

    @classmethod
    def published(cls) -> Shapes:
        c = beam_config_class()()
        return cls(c.hidden_size, c.num_hidden_layers, c.mlp_layer_types.count("dense"),
                   c.layer_types.count("sliding_attention"), c.sliding_window, c.num_attention_heads,
                   c.num_key_value_heads, c.head_dim, c.intermediate_size, c.moe_intermediate_size,
                   c.num_experts, c.num_experts_per_tok, c.vocab_size)

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def local_experts(self) -> int:
        return self.experts // CARDS

    @property
    def expert_bytes(self) -> int:  # w13 [2 x I, H] + w2 [H, I], FP8
        return 3 * self.moe_inter * self.hidden * FP8_BYTES


def fixed_bytes(s: Shapes) -> dict[str, float]:
    """Per card per step, independent of the batch: weights other than the experts."""
    q, kv = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
    attention = (3 * q * s.hidden + 2 * kv * s.hidden) * FP8_BYTES  # q, gate, o; k, v
    return {
        "attention": s.layers * attention / CARDS,
        "dense MLP": s.dense_layers * 3 * s.dense_inter * s.hidden * FP8_BYTES / CARDS,
        "router (fp32, every card)": s.moe_layers * s.experts * s.hidden * FP32_BYTES,
        "LM head (bf16)": s.vocab * s.hidden * BF16_BYTES / CARDS,
    }


def kv_bytes(s: Shapes, sequences: int, context: int) -> float:
    """bf16 K and V of this card's KV heads, whole blocks: sliding layers the window's blocks
    (one partial block more), full layers the whole context."""
    blocks = -(-context // BLOCK)
    window_blocks = min(blocks, -(-s.window // BLOCK) + 1)
    per_token_layer = 2 * (s.kv_heads // CARDS or 1) * s.head_dim * BF16_BYTES
    full_layers = s.layers - s.sliding_layers
    tokens = s.sliding_layers * window_blocks * BLOCK + full_layers * blocks * BLOCK
    return sequences * tokens * per_token_layer


def expert_bytes(s: Shapes, tokens: int, path: str) -> float:
    """Per card per step. stock: every local expert. gathered-fused: the G gathered experts once.
    gathered-copy: index_select reads G, writes G, the GEMMs read G again (3G)."""
    if path == "stock":
        return s.moe_layers * s.local_experts * s.expert_bytes
    g = gathered_count(tokens, s.top_k, s.local_experts)
    return s.moe_layers * g * s.expert_bytes * (3 if path == "gathered-copy" else 1)


def step_bytes(s: Shapes, tokens: int, sequences: int, context: int, path: str) -> float:
    return expert_bytes(s, tokens, path) + sum(fixed_bytes(s).values()) + kv_bytes(s, sequences, context)


# The DFlash2 plan's assumptions (beam_hpu/runtime/speculative/README.md, "Expected gain"), as
# card-check's verdict states them.
PLAN_VERIFY8, PLAN_BLOCK, PLAN_ACCEPTED = ASSUMED_VERIFY_8_RATIO, ASSUMED_BLOCK_SHARE, DFLASH2_ACCEPTED_TABLE


def dflash2_costs_from_card_check(path: Path) -> dict:
    """verify(8)/verify(1) and block/verify(1) from a card-check report's verify_rows and dflash2
    rows, with where each came from (the report's device label says whether a card measured it)."""
    report = json.loads(Path(path).read_text())
    by = {v["premise"]: v for v in report["verdicts"]}
    rows, gain = by["verify_rows"]["figures"], by["dflash2"]["figures"]
    top = max(rows["ratio_to_1_row"], key=int)
    return {"verify8": float(rows["ratio_to_1_row"][top]), "block": float(gain["block_over_verify_1"]),
            "label": report["label"], "stand_in": rows["stand_in"],
            "block_shard": by["dflash2_block"]["figures"]["shard"], "rows": int(top)}


def dflash2_rows(verify8: float, block: float, accepted: tuple[float, ...], one_stream_tok_s: float) -> list[dict]:
    """Per mean accepted length: the step's cost in 1-row steps, the gain and tokens/s."""
    cost = verify8 + block
    return [{"accepted": length, "cost": cost, "gain": dflash2_gain_model(verify8, block, length),
             "tok_s": one_stream_tok_s * dflash2_gain_model(verify8, block, length)} for length in accepted]


def print_dflash2(a, one_stream_tok_s: float) -> None:
    verify8, block = a.dflash2_verify8, a.dflash2_block
    where_verify = where_block = "assumed (the speculative README's plan)"
    if a.card_check:
        got = dflash2_costs_from_card_check(a.card_check)
        verify8, block = got["verify8"], got["block"]
        where_verify = (f"card-check {a.card_check}, verify_rows ratio_to_1_row at {got['rows']} rows "
                        f"[{got['label']}]; stand-in: {got['stand_in']}")
        where_block = (f"card-check {a.card_check}, dflash2 block_over_verify_1 (dflash2_block at batch 1 / "
                       f"verify_rows at 1 row) [{got['label']}]; {got['block_shard']}")
    print("\nDFlash2 at one stream: MODEL, not a measurement (block 8: the bonus token + 7 drafted)")
    print("  tok/s = one-stream tok/s x L / (verify(8)/verify(1) + block/verify(1))")
    print("Inputs")
    print(f"  one-stream decode {one_stream_tok_s:.1f} tok/s: measured (the recipe's {ONE_STREAM_TOK_S[0]}-"
          f"{ONE_STREAM_TOK_S[1]}, midpoint)")
    print(f"  verify(8)/verify(1) = {verify8:.3f}: {where_verify}")
    print("    confirmed on a card by: beam-hpu card-check's verify_rows row (ratio_to_1_row at 8)")
    print(f"  block/verify(1) = {block:.3f}: {where_block}")
    print("    confirmed on a card by: beam-hpu card-check's dflash2_block row over verify_rows at 1 row "
          "(the dflash2 row's block_over_verify_1)")
    print(f"  mean accepted length L = {' / '.join(f'{x:g}' for x in a.dflash2_accepted)}: assumed "
          "(the plan's; no Beam drafter run here)")
    print("    confirmed on a card by: benchmarks/spec_decode.py --spec dflash2=... on "
          "serving/launch-dflash2.sh (its accepted len, from the server's own counters)")
    if a.card_check and got["label"] == CPU_LABEL:
        print(f"  NOTE: the card-check report is {CPU_LABEL}: its costs only show the chain works")
    print("     L   step cost (1-row steps)   gain   tok/s")
    for r in dflash2_rows(verify8, block, tuple(a.dflash2_accepted), one_stream_tok_s):
        print(f"  {r['accepted']:4g}   {verify8:.3f} + {block:.3f} = {r['cost']:.3f}        "
              f"{r['gain']:5.2f}x {r['tok_s']:7.1f}")
    print("  the card measurement: single-stream tok/s on serving/launch-dflash2.sh against serving/launch.sh")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bandwidth-tbs", type=float, default=2.46, help="Gaudi 2 HBM2E, published")
    p.add_argument("--efficiency", type=float, default=1.0, help="fraction of it a step achieves")
    p.add_argument("--context", type=int, default=1024, help="tokens in each sequence's KV")
    p.add_argument("--drafts", type=int, default=4, help="k, as the recipe's speculative variant")
    p.add_argument("--accepted", type=float, default=2.0, help="mean tokens a verify step emits per sequence")
    p.add_argument("--dflash2-verify8", type=float, default=PLAN_VERIFY8,
                   help="DFlash2: a verify step of 8 rows over a 1-row decode step (plan: about 1)")
    p.add_argument("--dflash2-block", type=float, default=PLAN_BLOCK,
                   help="DFlash2: the drafter's block forward over a 1-row decode step (plan: about 0.1)")
    p.add_argument("--dflash2-accepted", type=float, nargs="+", default=list(PLAN_ACCEPTED),
                   help="DFlash2: mean accepted lengths (tokens a step emits) to tabulate")
    p.add_argument("--card-check", default=None,
                   help="a beam-hpu card-check JSON: DFlash2's two costs from its verify_rows and dflash2 rows")
    a = p.parse_args(argv)
    s = Shapes.published()
    bw = a.bandwidth_tbs * 1e12 * a.efficiency  # bytes/s

    def ms(nbytes):
        return nbytes / bw * 1e3

    print("MODEL, not a measurement: Beam-1.0-501B-A23B-FP8 decode on 8x Gaudi 2 (TP 8, EP 8)\n")
    print("Inputs")
    print(f"  shapes (BeamConfig defaults): hidden {s.hidden}, {s.layers} layers ({s.dense_layers} dense, "
          f"{s.moe_layers} MoE; {s.sliding_layers} sliding, window {s.window}), {s.q_heads} q / {s.kv_heads} kv "
          f"heads x {s.head_dim}, dense inter {s.dense_inter}, expert inter {s.moe_inter}, {s.experts} experts "
          f"top-{s.top_k}, vocab {s.vocab}")
    print(f"  one expert (w13 + w2, FP8): {s.expert_bytes / 1e6:.1f} MB; {s.local_experts} local experts per card "
          f"x {s.moe_layers} MoE layers = {expert_bytes(s, 1, 'stock') / GB:.1f} GB per card")
    print(f"  bandwidth: {a.bandwidth_tbs} TB/s x efficiency {a.efficiency} (assumed; published peak)")
    print(f"  KV: bf16, {s.kv_heads // CARDS or 1} kv head per card, {a.context} tokens per sequence, read in "
          f"whole {BLOCK}-token blocks")
    print("  activations, embeddings, norms, sampling: not counted (under 1 MB per step)")
    lo, hi = ONE_STREAM_TOK_S
    one = 1e3 / ((lo + hi) / 2)
    sixteen = 1e3 / (SIXTEEN_STREAMS_TOK_S / 16)
    print(f"  measured (recipe): 1 stream {lo}-{hi} tok/s -> step {1e3 / hi:.1f}-{1e3 / lo:.1f} ms "
          f"(midpoint {one:.1f}); 16 streams {SIXTEEN_STREAMS_TOK_S:.0f} tok/s -> step {sixteen:.1f} ms")
    print(f"  drafts: k = {a.drafts}, mean accepted length {a.accepted} (assumed; ngram, no drafter weights), "
          "verify step T = batch x (k + 1)")
    print("  premises: the stock fused op streams every local expert each step; host and device time add\n")

    print("Bytes per card per step, batch 1 (GB)")
    for name, value in fixed_bytes(s).items():
        print(f"  {name:28s} {value / GB:7.3f}")
    print(f"  {'KV (1 sequence)':28s} {kv_bytes(s, 1, a.context) / GB:7.3f}")
    for path in ("stock", "gathered-copy", "gathered-fused"):
        print(f"  {'experts, ' + path:28s} {expert_bytes(s, 1, path) / GB:7.3f}")
    print()

    dev1, dev16 = ms(step_bytes(s, 1, 1, a.context, "stock")), ms(step_bytes(s, 16, 16, a.context, "stock"))
    other1, other16 = one - dev1, sixteen - dev16
    print("What the recipe's figures imply (serial model, stock path)")
    print(f"  batch 1: bytes take {dev1:.1f} ms of the {one:.1f} ms step; the rest, {other1:.1f} ms "
          f"({other1 / one:.0%}), is host launch and everything else")
    print(f"  batch 16: bytes {dev16:.1f} ms of {sixteen:.1f} ms; rest {other16:.1f} ms ({other16 / sixteen:.0%})")
    print(f"  the 16-stream step is {sixteen - one:.1f} ms longer; its extra bytes (KV) explain "
          f"{dev16 - dev1:.2f} ms of that")
    print(f"  if instead the step is host-bound with the device hidden (the recipe's reading), the host "
          f"takes the whole {one:.1f} ms and no byte saved shortens it")
    if other1 < 0:
        print("  NOTE: negative rest: at this bandwidth the stock bytes alone exceed the measured step")
    print()

    def other(tokens):
        return other1 + (other16 - other1) * (tokens - 1) / 15

    print("Predicted decode (serial model); tok/s aggregate; '*' = T past 16, other() extrapolated")
    print("  (copy / fused: the gathered path taken at that T, its G experts copied by index_select or the gather")
    print(f"  fused into the GEMMs; variant: what launch-moe-gather.sh's BEAM_MOE_GATHER={VARIANT_LIMIT} runs, copy-fused where it gathers)")
    print("  batch  k  T    G | GB/card stock  copy  fused | step ms stock  copy fused | tok/s stock   copy  fused"
          " | variant tok/s")
    for k in (0, a.drafts):
        emitted = 1.0 if k == 0 else a.accepted
        for batch in BATCHES:
            tokens = batch * (k + 1)
            g = gathered_count(tokens, s.top_k, s.local_experts)
            nbytes = {path: step_bytes(s, tokens, batch, a.context, path)
                      for path in ("stock", "gathered-copy", "gathered-fused")}
            steps = {path: other(tokens) + ms(b) for path, b in nbytes.items()}
            rates = {path: batch * emitted * 1e3 / t for path, t in steps.items()}
            mark = "*" if tokens > 16 else " "
            print(f"  {batch:5d} {k:2d} {tokens:3d}{mark} {g:3d} |"
                  f"      {nbytes['stock'] / GB:6.1f} {nbytes['gathered-copy'] / GB:5.1f} "
                  f"{nbytes['gathered-fused'] / GB:6.1f} |"
                  f"      {steps['stock']:6.1f} {steps['gathered-copy']:5.1f} {steps['gathered-fused']:5.1f} |"
                  f"      {rates['stock']:6.1f} {rates['gathered-copy']:6.1f} {rates['gathered-fused']:6.1f} |"
                  + (f" {rates['gathered-copy']:.1f}-{rates['gathered-fused']:.1f}" if tokens <= VARIANT_LIMIT
                     else f" {rates['stock']:.1f}"))
    print()
    print("Where the gathered path can win: G < local experts (T x top-k < "
          f"{s.local_experts}, T <= {(s.local_experts - 1) // s.top_k}); with the copy only while 3G < "
          f"{s.local_experts} (T = 1). The variant's BEAM_MOE_GATHER={VARIANT_LIMIT} takes it at T <= "
          f"{VARIANT_LIMIT} only: batch-1 decode without drafts; every verify step (T >= 2) keeps the stock op.")
    t_copy, t_fused = other(1) + ms(step_bytes(s, 1, 1, a.context, "gathered-copy")), \
        other(1) + ms(step_bytes(s, 1, 1, a.context, "gathered-fused"))
    print("\nThe card measurement: single-stream tok/s, BEAM_MOE_GATHER=1 (launch-moe-gather.sh) against 0 (launch.sh)")
    print(f"  this model predicts {1e3 / t_copy:.1f} tok/s (gather copied) to {1e3 / t_fused:.1f} tok/s "
          f"(gather fused) against {1e3 / one:.1f}; within the stock runs' {lo}-{hi} tok/s refutes the "
          "premises (host-bound step, or the fused op already skips unrouted experts)")
    print_dflash2(a, 1e3 / one)


if __name__ == "__main__":
    main()
