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


def test_window_kv_build_against_a_decode_step():
    assert v.window_kv_build({1: 0.1, 32: 1.0}).verdict == "build cost small"
    assert v.window_kv_build({1: 0.1, 32: 5.0}).verdict == "build cost large"


def test_verify_rows_report_the_ratio_to_one_row():
    flat = v.verify_rows({t: 30.0 + 0.2 * t for t in range(1, 9)}, "stand-in")
    assert flat.verdict == "flat" and flat.figures["ratio_to_1_row"][1] == 1.0
    assert abs(flat.figures["ratio_to_1_row"][8] - 31.6 / 30.2) < 1e-12
    assert v.verify_rows({1: 30.0, 8: 45.0}, "stand-in").verdict == "grows"


def test_dflash2_gain_is_the_plans_arithmetic_on_the_figures():
    # The plan's assumptions: verify(8) = verify(1), block = a tenth of it: 2.5 / 1.1.
    plan = v.dflash2_gain({1: 34.0, 8: 34.0}, {1: 3.4})
    assert plan.verdict == "pays" and abs(plan.figures["gain"] - 2.5 / 1.1) < 1e-12
    assert abs(plan.figures["gain_by_accepted"][4.0] - 4.0 / 1.1) < 1e-12
    assert v.dflash2_gain_model(1.5, 0.5, 3.0) == 1.5
    # A verify step that grows with its rows and a block as costly as a step: no gain.
    off = v.dflash2_gain({1: 34.0, 8: 68.0}, {1: 34.0})
    assert off.verdict == "off: no gain" and abs(off.figures["gain"] - 2.5 / 3.0) < 1e-12
    # The verdict turns on the accepted length it is stated at.
    assert v.dflash2_gain({1: 34.0, 8: 68.0}, {1: 34.0}, accepted=4.0).verdict == "pays"
    assert v.dflash2_block({1: 2.0, 4: 3.0}, "shard").figures["ms_by_batch"][4] == 3.0
