"""Each switch's verdict as a pure function of measured figures: the thresholds are written once
here, each with why; nothing is decided without the figures (tests feed figures to show every
verdict turns with them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# A path must be this much faster to be worth a switch: below it the gain is within the run-to-run
# spread of a median over a few calls on a shared node.
SPEED_MARGIN = 0.10
# Gathered vs fused outputs: the two paths quantise the same intermediates, so on the card they
# may differ by the fused op's own roundings (bf16 SwiGLU and sum by our model of it), about one
# FP8 step; more than this is a different computation, not a rounding.
MAX_FP8_STEPS_APART = 2.0
# The fused op "skips" unrouted experts when 1 routed expert costs at most this share of 32.
SKIPS_UNROUTED_SHARE = 0.5
# The port's own share of a grouped step build may take this share of a decode step (34 ms: the
# recipe's 29.5 tok/s single stream) before it is worth a card profile of its own.
DECODE_STEP_MS = 1000 / 29.5
STEP_BUILD_SHARE = 0.05
# A verify step is static when warm-up covered every draft count: no compile after it.
MAX_COMPILES_AFTER_WARMUP = 0
# DFlash2 (beam_hpu/runtime/speculative/README.md, "Expected gain"): the plan assumes a verify step
# of 8 rows costs about one decode step and the drafter's block about a tenth of one; a figure
# within SPEED_MARGIN of those is "as assumed".
ASSUMED_VERIFY_8_RATIO = 1.0
ASSUMED_BLOCK_SHARE = 0.1
# The mean accepted length the verdict is stated at: the plan's lowest (2.5 of 2.5 / 3.5 / 4), so
# "pays" does not rest on a drafter better than the least it expects; the others are figures.
DFLASH2_ACCEPTED = 2.5
DFLASH2_ACCEPTED_TABLE = (2.5, 3.5, 4.0)
# Speculation is worth its variant when it beats plain decode by more than the run-to-run spread.
MIN_SPECULATIVE_GAIN = 1 + SPEED_MARGIN
DFLASH2_SWITCH = "--speculative-config dflash (serving/launch-dflash2.sh)"


@dataclass
class Verdict:
    premise: str
    switch: str
    verdict: str
    why: str
    figures: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def moe_gather(fused_ms: dict[int, float], gathered_ms: dict[int, float], fp8_steps_apart: float) -> Verdict:
    """BEAM_MOE_GATHER: on only if the gathered path is faster where a single stream decodes (one
    routed local expert at T = 1 under EP 8) and computes the same thing."""
    figures = {"fused_ms": fused_ms, "gathered_ms": gathered_ms, "fp8_steps_apart": fp8_steps_apart}
    skips = fused_ms[1] <= SKIPS_UNROUTED_SHARE * fused_ms[max(fused_ms)]
    figures["fused_op_skips_unrouted_experts"] = skips
    if fp8_steps_apart > MAX_FP8_STEPS_APART:
        return Verdict("moe", "BEAM_MOE_GATHER", "keep 0",
                       f"the paths differ by {fp8_steps_apart:.1f} FP8 steps (> {MAX_FP8_STEPS_APART}): not the same computation",
                       figures)
    if gathered_ms[1] <= (1 - SPEED_MARGIN) * fused_ms[1]:
        return Verdict("moe", "BEAM_MOE_GATHER", "1 pays",
                       f"one routed expert: gathered {gathered_ms[1]:.3f} ms vs fused {fused_ms[1]:.3f} ms", figures)
    return Verdict("moe", "BEAM_MOE_GATHER", "keep 0",
                   f"one routed expert: gathered {gathered_ms[1]:.3f} ms is not {SPEED_MARGIN:.0%} under fused "
                   f"{fused_ms[1]:.3f} ms" + (" (the fused op already skips unrouted experts)" if skips else ""),
                   figures)


def cast_rounding(equal_to_input_dtype_product: float, equal_to_fp32_product: float) -> Verdict:
    """Which model of cast_to_fp8_v2 the card follows (fractions of elements equal to each):
    what beam_hpu.quant.rounding's Gaudi mode and the tree stand-ins assume."""
    figures = {"equal_to_input_dtype_product": equal_to_input_dtype_product,
               "equal_to_fp32_product": equal_to_fp32_product}
    if equal_to_input_dtype_product == 1.0:
        return Verdict("cast", "rounding model (Gaudi mode)", "holds",
                       "the cast rounds the product in the input's dtype, as the Gaudi mode models it", figures)
    if equal_to_fp32_product == 1.0:
        return Verdict("cast", "rounding model (Gaudi mode)", "wrong: fp32 product",
                       "the cast rounds the fp32 product once: switch the Gaudi mode to fp32_product_cast_to_fp8",
                       figures)
    return Verdict("cast", "rounding model (Gaudi mode)", "wrong: neither model",
                   "the card's cast matches neither model on every element", figures)


def storage_identity(param_pointer: int, view_pointer: int, view_offset_bytes: int) -> Verdict:
    """Whether a storage pointer would tell a parameter's views apart on this device. Nothing of the
    port asks it any more (the loader follows views at dispatch, window-KV code compares objects):
    "pointers unusable" confirms that premise, "pointers usable" says it costs nothing here."""
    figures = {"param_pointer_is_zero": param_pointer == 0, "view_shares_storage": view_pointer == param_pointer,
               "view_offset_bytes": view_offset_bytes}
    if param_pointer != 0 and view_pointer == param_pointer:
        return Verdict("storage", "--load-format beam (ParamIndex)", "pointers usable",
                       "parameters report a storage pointer and their views share it", figures)
    return Verdict("storage", "--load-format beam (ParamIndex)", "pointers unusable",
                   "a null pointer or a view with a storage of its own: identity must not come from pointers",
                   figures)


def fsdpa_tiles(by_context: dict[int, dict]) -> Verdict:
    """BEAM_FSDPA_Q_TILE / BEAM_FSDPA_WS_GIB: per context, {"untiled_ms": float | None (None: the
    single call failed), "tiled_ms": float, "calls": int}. The tiles pay where the single call
    fails or is not faster; a context where tiling makes one call anyway says nothing."""
    slower = {ctx: f for ctx, f in by_context.items()
              if f["calls"] > 1 and f["untiled_ms"] is not None and f["tiled_ms"] > (1 + SPEED_MARGIN) * f["untiled_ms"]}
    if slower:
        worst = max(slower, key=lambda c: slower[c]["tiled_ms"] / slower[c]["untiled_ms"])
        return Verdict("fsdpa", "BEAM_FSDPA_Q_TILE / BEAM_FSDPA_WS_GIB", "raise BEAM_FSDPA_WS_GIB",
                       f"at {worst} tokens of context the tiles take {slower[worst]['tiled_ms']:.2f} ms against the "
                       f"single call's {slower[worst]['untiled_ms']:.2f} ms", by_context)
    return Verdict("fsdpa", "BEAM_FSDPA_Q_TILE / BEAM_FSDPA_WS_GIB", "keep",
                   "wherever the rule tiles, the tiles are no slower than the single call, or it fails", by_context)


def verify_step(compiles_after_warmup: int | None, ms_by_draft_count: dict[int, float]) -> Verdict:
    """Sampled verify steps: static when no draft count compiles a graph after the warm-up."""
    figures = {"compiles_after_warmup": compiles_after_warmup, "ms_by_draft_count": ms_by_draft_count}
    if compiles_after_warmup is None:
        return Verdict("verify", "--speculative-config (sampled)", "unknown",
                       "no graph-compilation counter here: run on the card", figures)
    if compiles_after_warmup > MAX_COMPILES_AFTER_WARMUP:
        return Verdict("verify", "--speculative-config (sampled)", "recompiles",
                       f"{compiles_after_warmup} graph compilations after warm-up over random draft counts", figures)
    return Verdict("verify", "--speculative-config (sampled)", "static",
                   "no graph compilation after warm-up over random draft counts", figures)


def verify_rows(ms_by_rows: dict[int, float], stand_in: str) -> Verdict:
    """One sequence's verify step at T = 1..8 rows (what stands for it: `stand_in`): ms and the
    ratio of T rows to 1; "flat" when 8 rows cost at most SPEED_MARGIN over the plan's assumption."""
    ratio = {t: ms / ms_by_rows[1] for t, ms in ms_by_rows.items()}
    figures = {"ms_by_rows": ms_by_rows, "ratio_to_1_row": ratio, "stand_in": stand_in}
    top = max(ms_by_rows)
    flat = ratio[top] <= (1 + SPEED_MARGIN) * ASSUMED_VERIFY_8_RATIO
    return Verdict("verify_rows", DFLASH2_SWITCH, "flat" if flat else "grows",
                   f"{top} rows cost {ratio[top]:.2f}x 1 row ({'within' if flat else 'over'} "
                   f"{SPEED_MARGIN:.0%} of the plan's {ASSUMED_VERIFY_8_RATIO:.1f}x)", figures)


def dflash2_block(ms_by_batch: dict[int, float], shard: str) -> Verdict:
    """The drafter's step (context update + block forward + selector) per batch, on one card's
    shard (`shard`). Its share of a verify step is dflash2_gain's, which has both figures."""
    figures = {"ms_by_batch": ms_by_batch, "shard": shard}
    return Verdict("dflash2_block", DFLASH2_SWITCH, "measured",
                   f"batch 1: {ms_by_batch[1]:.3f} ms a block; its share of a verify step is the dflash2 row's",
                   figures)


def dflash2_gain_model(verify_8_ratio: float, block_share: float, accepted: float) -> float:
    """Single-stream tokens per unit time against plain decode: a step emits `accepted` tokens on
    average and costs a verify step of 8 rows plus the drafter's block, in units of a 1-row step."""
    return accepted / (verify_8_ratio + block_share)


def dflash2_gain(verify_ms_by_rows: dict[int, float], block_ms_by_batch: dict[int, float],
                 accepted: float = DFLASH2_ACCEPTED) -> Verdict:
    """--speculative-config dflash at one stream: on when the modelled gain at `accepted` clears
    MIN_SPECULATIVE_GAIN; the gain at each length of DFLASH2_ACCEPTED_TABLE is reported beside it."""
    one, eight = verify_ms_by_rows[1], verify_ms_by_rows[max(verify_ms_by_rows)]
    ratio, share = eight / one, block_ms_by_batch[1] / one
    gains = {length: dflash2_gain_model(ratio, share, length) for length in DFLASH2_ACCEPTED_TABLE}
    gain = dflash2_gain_model(ratio, share, accepted)
    figures = {"verify_8_over_1": ratio, "block_over_verify_1": share, "accepted": accepted, "gain": gain,
               "gain_by_accepted": gains, "assumed": {"verify_8_over_1": ASSUMED_VERIFY_8_RATIO,
                                                      "block_over_verify_1": ASSUMED_BLOCK_SHARE}}
    arithmetic = f"{accepted} / ({ratio:.2f} + {share:.2f}) = {gain:.2f}x"
    if gain >= MIN_SPECULATIVE_GAIN:
        return Verdict("dflash2", DFLASH2_SWITCH, "pays", f"single stream at L = {accepted}: {arithmetic}", figures)
    return Verdict("dflash2", DFLASH2_SWITCH, "off: no gain",
                   f"single stream at L = {accepted}: {arithmetic}, under {MIN_SPECULATIVE_GAIN:.2f}x", figures)


def window_kv_build(build_ms: dict[int, float]) -> Verdict:
    """BEAM_WINDOW_KV: the port's own share of a grouped step build, per batch size."""
    worst = max(build_ms.values())
    figures = {"build_ms_by_batch": build_ms, "decode_step_ms": DECODE_STEP_MS}
    if worst <= STEP_BUILD_SHARE * DECODE_STEP_MS:
        return Verdict("window_kv", "BEAM_WINDOW_KV", "build cost small",
                       f"at most {worst:.3f} ms per step, under {STEP_BUILD_SHARE:.0%} of a decode step", figures)
    return Verdict("window_kv", "BEAM_WINDOW_KV", "build cost large",
                   f"{worst:.3f} ms per step, over {STEP_BUILD_SHARE:.0%} of a decode step: profile the runner's "
                   "six builds before turning it on", figures)
