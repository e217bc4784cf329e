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
# The port's own share of a grouped step build may take this share of a decode step (the engine
# A/B's measured batch-1 step of the recipe's engine) before it is worth a card profile of its own.
STEP_BUILD_SHARE = 0.05
# A verify step is static when warm-up covered every draft count: no compile after it.
MAX_COMPILES_AFTER_WARMUP = 0
# DFlash2 (beam_hpu/runtime/speculative/README.md, "Expected gain"): the plan assumes a verify step
# of 8 rows costs about one decode step and the drafter's block about a tenth of one; a figure
# within SPEED_MARGIN of those is "as assumed".
ASSUMED_VERIFY_8_RATIO = 1.0
ASSUMED_BLOCK_SHARE = 0.1
# The plan's accepted lengths (beam_hpu/runtime/speculative/README.md): reported beside the gain the
# premise rows model at the accepted length the engine A/B measured; no verdict is stated at them.
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
                 accepted: float | None) -> Verdict:
    """The premise rows' model of --speculative-config dflash at one stream, at the accepted length
    the engine A/B measured from the served drafter (None: not measured, no verdict); the gain at
    each length of DFLASH2_ACCEPTED_TABLE is reported beside it. A diagnostic: the engine A/B's
    measured tokens per second are the switch's verdict."""
    one, eight = verify_ms_by_rows[1], verify_ms_by_rows[max(verify_ms_by_rows)]
    ratio, share = eight / one, block_ms_by_batch[1] / one
    gains = {length: dflash2_gain_model(ratio, share, length) for length in DFLASH2_ACCEPTED_TABLE}
    figures = {"verify_8_over_1": ratio, "block_over_verify_1": share, "accepted": accepted,
               "gain_by_accepted": gains, "assumed": {"verify_8_over_1": ASSUMED_VERIFY_8_RATIO,
                                                      "block_over_verify_1": ASSUMED_BLOCK_SHARE}}
    if accepted is None:
        return Verdict("dflash2", DFLASH2_SWITCH, "unknown",
                       "no accepted length measured (the engine A/B's DFlash2 run did not run)", figures)
    gain = figures["gain"] = dflash2_gain_model(ratio, share, accepted)
    arithmetic = f"{accepted:.2f} / ({ratio:.2f} + {share:.2f}) = {gain:.2f}x"
    if gain >= MIN_SPECULATIVE_GAIN:
        return Verdict("dflash2", DFLASH2_SWITCH, "pays", f"single stream at measured L: {arithmetic}", figures)
    return Verdict("dflash2", DFLASH2_SWITCH, "off: no gain",
                   f"single stream at measured L: {arithmetic}, under {MIN_SPECULATIVE_GAIN:.2f}x", figures)


def window_kv_build(build_ms: dict[int, float], decode_step_ms: float | None) -> Verdict:
    """BEAM_WINDOW_KV: the port's own share of a grouped step build, per batch size, against the
    recipe engine's measured batch-1 decode step (None: not measured, no verdict)."""
    worst = max(build_ms.values())
    figures = {"build_ms_by_batch": build_ms, "decode_step_ms": decode_step_ms}
    if decode_step_ms is None:
        return Verdict("window_kv", "BEAM_WINDOW_KV", "unknown",
                       f"at most {worst:.3f} ms per step; no decode step measured to weigh it against", figures)
    if worst <= STEP_BUILD_SHARE * decode_step_ms:
        return Verdict("window_kv", "BEAM_WINDOW_KV", "build cost small",
                       f"at most {worst:.3f} ms per step, under {STEP_BUILD_SHARE:.0%} of the measured "
                       f"{decode_step_ms:.2f} ms decode step", figures)
    return Verdict("window_kv", "BEAM_WINDOW_KV", "build cost large",
                   f"{worst:.3f} ms per step, over {STEP_BUILD_SHARE:.0%} of the measured {decode_step_ms:.2f} ms "
                   "decode step: profile the runner's six builds before turning it on", figures)


# -- the engine A/B (engine_ab.py): each switch judged from its settings' served figures ----------

def summary(run: dict) -> dict:
    """The figures a verdict reads from one engine run (engine_run.py's output): decode step ms and
    compile ms per batch, TTFT per context, tokens per second at one stream, accepted length; per
    batch the graph probe's node-level figures where a card gave them."""
    if "error" in run:
        return {"error": run["error"]}
    decode = run["decode"]
    return {"step_ms": {int(b): d["step_ms"] for b, d in decode.items()},
            "compile_ms": {int(b): d["compile_ms"] for b, d in decode.items()},
            "ttft_ms": {int(c): ms for c, ms in run["ttft_ms"].items()},
            "tok_s_1": decode["1"]["tok_s"] if "1" in decode else None,
            "accepted_length": run.get("accepted_length"),
            "start_to_first_token_ms": run.get("start_to_first_token_ms"),
            "node": {int(b): d["node"] for b, d in decode.items() if d.get("node", {}).get("available")},
            "node_why": next((d["node"]["why"] for d in decode.values() if "why" in d.get("node", {})), None)}


def first_difference(a: dict, b: dict) -> str | None:
    """Where two engine runs' greedy tokens first differ (batch, request, token), or None."""
    for batch, run in a["decode"].items():
        for r, (x, y) in enumerate(zip(run["tokens"], b["decode"][batch]["tokens"])):
            if x != y:
                k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                return f"batch {batch}, request {r}, token {k}"
    return None


def _ratios(base: dict, other: dict, key: str) -> dict[int, float]:
    return {k: other[key][k] / base[key][k] for k in base[key] if base[key][k] and other[key].get(k)}


def _speculative(base: dict, on: dict) -> tuple[str | None, str]:
    gain = on["gain"] = on["tok_s_1"] / base["tok_s_1"]
    said = f"one stream {on['tok_s_1']:.1f} vs {base['tok_s_1']:.1f} tok/s ({gain:.2f}x)"
    if on["accepted_length"] is not None:
        said += f", accepted length {on['accepted_length']:.2f}"
    if on["tokens_differ_at"]:
        return None, f"greedy tokens differ at {on['tokens_differ_at']}: not lossless; {said}"
    if gain >= MIN_SPECULATIVE_GAIN:
        return "pays", said
    return None, f"{said}, under {MIN_SPECULATIVE_GAIN:.2f}x"


def _startup(base: dict, on: dict) -> tuple[str | None, str]:
    ratio = on["startup_ratio"] = on["start_to_first_token_ms"] / base["start_to_first_token_ms"]
    said = (f"engine start to first token {on['start_to_first_token_ms'] / 1e3:.1f} s against "
            f"{base['start_to_first_token_ms'] / 1e3:.1f} s ({ratio:.2f}x)")
    if on["tokens_differ_at"]:
        return None, f"greedy tokens differ at {on['tokens_differ_at']}; {said}"
    return ("pays" if ratio <= 1 - SPEED_MARGIN else None), said


def _prefill(base: dict, on: dict) -> tuple[str | None, str]:
    ratio = on["ttft_ratio"] = _ratios(base, on, "ttft_ms")
    said = ", ".join(f"{c}: {r:.2f}x" for c, r in ratio.items())
    if ratio and all(r <= 1 - SPEED_MARGIN for r in ratio.values()):
        return "pays", f"the prompt in one call is faster at every context: {said}"
    return None, f"untiled TTFT / tiled: {said}"


def _cost(base: dict, on: dict) -> tuple[str | None, str]:
    ratio = on["step_ratio"] = _ratios(base, on, "step_ms")
    worst = max(ratio.values())
    said = "decode step on / off: " + ", ".join(f"batch {b}: {r:.2f}x" for b, r in ratio.items())
    if worst <= 1 + SPEED_MARGIN:
        return "affordable", said
    return None, f"{said}: costs {worst - 1:.0%}"


# The kinds judged on the recipe's setting against one other: (word after the setting's name, or
# None to keep the recipe's; why)
TWO_SETTING_JUDGES = {"speculative": _speculative, "startup": _startup, "prefill": _prefill, "cost": _cost}


def engine_switch(switch: str, kind: str, runs: dict[str, dict], acts_here: bool = True) -> Verdict:
    """One switch from its engine runs ({setting: engine_run output}, the recipe's first). kind:
    speed (on pays when batch 1 decodes SPEED_MARGIN faster, no batch is slower by more, greedy
    tokens equal); cost (a numerics switch: affordable when no batch decodes SPEED_MARGIN slower);
    prefill (the recipe's FSDPA tiles stay unless the untiled prompt is SPEED_MARGIN faster at every
    context, or keep them where it fails); choice (the fastest batch-1 setting with the recipe's
    tokens, when SPEED_MARGIN faster); speculative (pays when tokens per second at one stream gain
    MIN_SPECULATIVE_GAIN with the recipe's greedy tokens); startup (a restart: engine start to first
    token SPEED_MARGIN faster with the recipe's tokens). `acts_here` False: the engine here does
    not read the switch: "not read here", with the settings' spread as this host's noise."""
    names = list(runs)
    recipe = names[0]
    figures = {name: summary(run) for name, run in runs.items()}
    for name in names[1:]:
        if "error" not in runs[name] and "error" not in runs[recipe]:
            figures[name]["tokens_differ_at"] = first_difference(runs[recipe], runs[name])
    if "error" in runs[recipe]:
        return Verdict("engine", switch, "unknown", f"the recipe's engine failed: {runs[recipe]['error']}", figures)
    base = figures[recipe]
    if not acts_here:
        # Its settings served one computation: how far their batch-1 steps spread is this host's
        # run-to-run noise, which a verdict here would only restate.
        steps = [f["step_ms"][1] for f in figures.values() if "error" not in f and f["step_ms"].get(1)]
        spread = max(steps) / min(steps) - 1 if steps else 0.0
        figures["run_to_run_spread"] = spread
        return Verdict("engine", switch, "not read here",
                       f"this engine does not read the switch, so its settings served one computation; their "
                       f"batch-1 decode steps spread {spread:.0%}: this host's run-to-run noise, against which "
                       f"a verdict's {SPEED_MARGIN:.0%} margin would mean nothing", figures)

    def verdict(word: str, why: str) -> Verdict:
        return Verdict("engine", switch, word, why, figures)

    judge = TWO_SETTING_JUDGES.get(kind)
    if judge is not None:
        on = names[1]
        if "error" in runs[on]:
            return verdict(f"keep {recipe}", f"{on} failed: {runs[on]['error'][:200]}")
        word, why = judge(base, figures[on])
        return verdict(f"{on} {word}" if word else f"keep {recipe}", why)
    # speed and choice: the candidates that kept the recipe's tokens and ran
    candidates = {}
    for name in names[1:]:
        f = figures[name]
        if "error" in f or f.get("tokens_differ_at"):
            continue
        ratio = _ratios(base, f, "step_ms")
        f["step_ratio"] = ratio
        if ratio.get(1, 1.0) <= 1 - SPEED_MARGIN and all(r <= 1 + SPEED_MARGIN for r in ratio.values()):
            candidates[name] = ratio[1]
    rejected = {n: (f"failed: {figures[n]['error'][:200]}" if "error" in figures[n]
                    else f"not the same output (tokens differ at {figures[n]['tokens_differ_at']})")
                for n in names[1:] if "error" in figures[n] or figures[n].get("tokens_differ_at")}
    tail = "".join(f"; {n} {why}" for n, why in rejected.items())
    if candidates:
        best = min(candidates, key=candidates.get)
        return verdict(f"{best} pays", f"batch-1 decode step {candidates[best]:.2f}x the recipe's{tail}")
    steps = ", ".join(f"{n}: {figures[n]['step_ms'].get(1, float('nan')):.2f} ms" for n in names
                      if "error" not in figures[n])
    return verdict(f"keep {recipe}", f"no setting decodes {SPEED_MARGIN:.0%} faster at batch 1 ({steps}){tail}")
