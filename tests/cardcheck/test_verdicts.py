"""Each card-check verdict turns with the figures fed to it (no timing here: figures are given)."""

from beam_hpu.cardcheck import verdicts as v


def test_moe_gather_turns_on_speed_and_agreement():
    fused = {1: 1.0, 8: 1.0, 32: 1.0}
    assert v.moe_gather(fused, {1: 0.5, 8: 0.9, 32: 1.2}, 1.0).verdict == "1 pays"
    assert v.moe_gather(fused, {1: 0.95, 8: 0.9, 32: 1.2}, 1.0).verdict == "keep 0"  # within the margin
    assert v.moe_gather(fused, {1: 0.5, 8: 0.9, 32: 1.2}, 3.0).verdict == "keep 0"  # not the same computation
    skipping = v.moe_gather({1: 0.2, 8: 0.6, 32: 1.0}, {1: 0.25, 8: 0.9, 32: 1.2}, 1.0)
    assert skipping.verdict == "keep 0" and skipping.figures["fused_op_skips_unrouted_experts"]


def test_cast_rounding_names_the_model_the_card_follows():
    assert v.cast_rounding(1.0, 0.97).verdict == "holds"
    assert v.cast_rounding(0.97, 1.0).verdict == "wrong: fp32 product"
    assert v.cast_rounding(0.99, 0.98).verdict == "wrong: neither model"


def test_storage_identity_needs_a_pointer_that_views_share():
    assert v.storage_identity(4096, 4096, 512).verdict == "pointers usable"
    assert v.storage_identity(0, 0, 0).verdict == "pointers unusable"
    assert v.storage_identity(4096, 8192, 0).verdict == "pointers unusable"


def test_fsdpa_tiles_are_judged_where_the_rule_tiles():
    fine = {4096: {"untiled_ms": 10.0, "tiled_ms": 10.5, "calls": 16}, 65536: {"untiled_ms": None, "tiled_ms": 90.0, "calls": 16}}
    assert v.fsdpa_tiles(fine).verdict == "keep"
    slow = {**fine, 16384: {"untiled_ms": 20.0, "tiled_ms": 30.0, "calls": 16}}
    assert v.fsdpa_tiles(slow).verdict == "raise BEAM_FSDPA_WS_GIB"
    one_call = {16384: {"untiled_ms": 20.0, "tiled_ms": 30.0, "calls": 1}}  # no tiles: nothing to judge
    assert v.fsdpa_tiles(one_call).verdict == "keep"


def test_verify_step_is_static_only_without_compiles():
    assert v.verify_step(0, {8: 1.0}).verdict == "static"
    assert v.verify_step(3, {8: 1.0}).verdict == "recompiles"
    assert v.verify_step(None, {8: 1.0}).verdict == "unknown"


def test_window_kv_build_against_the_measured_decode_step():
    assert v.window_kv_build({1: 0.1, 32: 1.0}, 34.0).verdict == "build cost small"
    assert v.window_kv_build({1: 0.1, 32: 5.0}, 34.0).verdict == "build cost large"
    # the same build against a slower measured step
    assert v.window_kv_build({1: 0.1, 32: 5.0}, 200.0).verdict == "build cost small"
    assert v.window_kv_build({1: 0.1, 32: 5.0}, None).verdict == "unknown"


def test_verify_rows_report_the_ratio_to_one_row():
    flat = v.verify_rows({t: 30.0 + 0.2 * t for t in range(1, 9)}, "stand-in")
    assert flat.verdict == "flat" and flat.figures["ratio_to_1_row"][1] == 1.0
    assert abs(flat.figures["ratio_to_1_row"][8] - 31.6 / 30.2) < 1e-12
    assert v.verify_rows({1: 30.0, 8: 45.0}, "stand-in").verdict == "grows"


def test_dflash2_gain_is_the_plans_arithmetic_at_the_measured_accepted_length():
    # verify(8) = verify(1), block = a tenth of it, L measured 2.5: 2.5 / 1.1.
    plan = v.dflash2_gain({1: 34.0, 8: 34.0}, {1: 3.4}, 2.5)
    assert plan.verdict == "pays" and abs(plan.figures["gain"] - 2.5 / 1.1) < 1e-12
    assert abs(plan.figures["gain_by_accepted"][4.0] - 4.0 / 1.1) < 1e-12
    assert v.dflash2_gain_model(1.5, 0.5, 3.0) == 1.5
    # A verify step that grows with its rows and a block as costly as a step: no gain.
    off = v.dflash2_gain({1: 34.0, 8: 68.0}, {1: 34.0}, 2.5)
    assert off.verdict == "off: no gain" and abs(off.figures["gain"] - 2.5 / 3.0) < 1e-12
    # The verdict turns on the accepted length measured, and without one there is none.
    assert v.dflash2_gain({1: 34.0, 8: 68.0}, {1: 34.0}, 4.0).verdict == "pays"
    assert v.dflash2_gain({1: 34.0, 8: 34.0}, {1: 3.4}, None).verdict == "unknown"
    assert v.dflash2_block({1: 2.0, 4: 3.0}, "shard").figures["ms_by_batch"][4] == 3.0


# -- the engine A/B: figures as engine_run.py writes them ---------------------------------------

def run(step_ms: dict[int, float], tokens=None, ttft=None, tok_s=None, accepted=None) -> dict:
    tokens = tokens or [[1, 2, 3]]
    out = {"decode": {str(b): {"step_ms": ms, "compile_ms": 5.0, "tokens": tokens,
                               "tok_s": tok_s if tok_s is not None else 1000 / ms} for b, ms in step_ms.items()},
           "ttft_ms": {str(c): ms for c, ms in (ttft or {256: 10.0}).items()}}
    if accepted is not None:
        out["accepted_length"] = accepted
    return out


def test_a_speed_switch_pays_only_faster_and_with_the_recipes_tokens():
    recipe = run({1: 10.0, 4: 12.0})
    assert v.engine_switch("S", "speed", {"0": recipe, "1": run({1: 8.0, 4: 12.0})}).verdict == "1 pays"
    assert v.engine_switch("S", "speed", {"0": recipe, "1": run({1: 9.5, 4: 12.0})}).verdict == "keep 0"
    # faster at batch 1, slower at batch 4 by more than the margin
    assert v.engine_switch("S", "speed", {"0": recipe, "1": run({1: 8.0, 4: 14.0})}).verdict == "keep 0"
    differs = v.engine_switch("S", "speed", {"0": recipe, "1": run({1: 5.0, 4: 6.0}, tokens=[[1, 2, 4]])})
    assert differs.verdict == "keep 0" and "token 2" in differs.why
    assert v.engine_switch("S", "speed", {"0": recipe, "1": {"error": "oom"}}).verdict == "keep 0"
    # An engine that does not read the switch judges nothing: the settings' spread is its noise.
    off_here = v.engine_switch("S", "speed", {"0": recipe, "1": run({1: 8.0, 4: 12.0})}, acts_here=False)
    assert off_here.verdict == "not read here" and abs(off_here.figures["run_to_run_spread"] - 0.25) < 1e-12


def test_a_choice_takes_the_fastest_setting_that_keeps_the_tokens():
    runs = {"1": run({1: 10.0}), "4": run({1: 8.5}), "13": run({1: 7.0}), "52": run({1: 5.0}, tokens=[[9]])}
    chosen = v.engine_switch("VLLM_CONFIG_HIDDEN_LAYERS", "choice", runs)
    assert chosen.verdict == "13 pays" and "52 not the same output" in chosen.why
    assert v.engine_switch("H", "choice", {"1": run({1: 10.0}), "4": run({1: 9.5})}).verdict == "keep 1"


def test_a_cost_switch_is_affordable_within_the_margin():
    recipe = run({1: 10.0, 4: 12.0})
    assert v.engine_switch("R", "cost", {"0": recipe, "1": run({1: 10.5, 4: 12.5})}).verdict == "1 affordable"
    costly = v.engine_switch("R", "cost", {"0": recipe, "1": run({1: 12.0, 4: 12.0})})
    assert costly.verdict == "keep 0" and "costs 20%" in costly.why


def test_the_fsdpa_tiles_stay_unless_one_call_is_faster_everywhere():
    tiled = run({1: 10.0}, ttft={16384: 100.0, 131072: 900.0})
    faster = run({1: 10.0}, ttft={16384: 80.0, 131072: 700.0})
    assert v.engine_switch("T", "prefill", {"tiles": tiled, "untiled": faster}).verdict == "untiled pays"
    mixed = run({1: 10.0}, ttft={16384: 80.0, 131072: 950.0})
    assert v.engine_switch("T", "prefill", {"tiles": tiled, "untiled": mixed}).verdict == "keep tiles"
    assert v.engine_switch("T", "prefill", {"tiles": tiled, "untiled": {"error": "oom"}}).verdict == "keep tiles"


def test_dflash2_pays_on_measured_one_stream_speed_and_lossless_tokens():
    off = run({1: 10.0}, tok_s=100.0)
    pays = v.engine_switch("D", "speculative", {"off": off, "dflash2": run({1: 10.0}, tok_s=150.0, accepted=2.1)})
    assert pays.verdict == "dflash2 pays" and "accepted length 2.10" in pays.why
    assert pays.figures["dflash2"]["gain"] == 1.5
    assert v.engine_switch("D", "speculative", {"off": off, "dflash2": run({1: 10.0}, tok_s=105.0)}).verdict == "keep off"
    lossy = v.engine_switch("D", "speculative", {"off": off, "dflash2": run({1: 10.0}, [[1, 9, 3]], tok_s=300.0)})
    assert lossy.verdict == "keep off" and "not lossless" in lossy.why


def test_a_warm_recipe_cache_pays_when_a_restart_reaches_its_first_token_sooner():
    cold = {**run({1: 10.0}), "start_to_first_token_ms": 600_000.0}
    warm = {**run({1: 10.0}), "start_to_first_token_ms": 120_000.0}
    paid = v.engine_switch("C", "startup", {"no cache": cold, "warm cache": warm})
    assert paid.verdict == "warm cache pays" and "600.0 s" in paid.why
    same = {**run({1: 10.0}), "start_to_first_token_ms": 580_000.0}
    assert v.engine_switch("C", "startup", {"no cache": cold, "warm cache": same}).verdict == "keep no cache"


def test_no_verdict_reads_an_assumed_accepted_length_or_step_time():
    assert not hasattr(v, "DFLASH2_ACCEPTED") and not hasattr(v, "DECODE_STEP_MS")
