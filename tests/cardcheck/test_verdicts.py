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
