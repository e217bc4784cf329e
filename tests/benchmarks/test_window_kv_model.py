"""benchmarks/window_kv_model.py: its counts against the definitions (a model, so no timing)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "window_kv_model", Path(__file__).resolve().parents[2] / "benchmarks" / "window_kv_model.py")
wm = sys.modules.setdefault("window_kv_model", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(wm)


def oracle_blocks(pos: int, window: int | None, bs: int) -> int:
    """Blocks holding the keys a decode query at `pos` attends (window None = every key)."""
    lo = 0 if window is None else max(0, pos - window + 1)
    return pos // bs - lo // bs + 1


def test_per_row_blocks_are_the_windows():
    for ctx in (0, 1, 127, 128, 511, 512, 513, 4095, 262_143):
        rows = wm.per_row_kv_blocks(ctx, 512, 128)
        assert rows["full layer"] == oracle_blocks(ctx, None, 128)
        # The worst alignment needs 5 blocks; the window-sized cache gathers the same list as the
        # port's exact window, which always holds the window's keys.
        exact = rows["sliding layer, beam-exact-window (full-context cache)"]
        assert rows["sliding layer, window-sized cache"] == exact
        assert rows["sliding layer, window-sized cache"] >= oracle_blocks(ctx, 512, 128)
        assert rows["sliding layer, stock vllm-gaudi"] == min(4, ctx // 128 + 1)


def test_step_kv_bytes_count_whole_blocks():
    # One row at 256K: 9 full layers x 2,048 blocks + 43 sliding x 5, bf16 pages of 64 KiB.
    assert wm.step_kv_bytes(1, 262_143, 512, 128, 9, 43) == (9 * 2048 + 43 * 5) * 65_536
    assert wm.step_kv_bytes(16, 262_143, 512, 128, 9, 43) == 16 * wm.step_kv_bytes(1, 262_143, 512, 128, 9, 43)


def test_report_names_batches_and_the_card_measurement(capsys):
    assert wm.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("MODEL, not a measurement.")
    assert "-> batch  2;" in out and "-> batch 16;" in out
    assert "Confirm on a card" in out


def test_sliding_lists_pad_to_the_4k_tier_in_the_recipes_file_and_fill_the_window_tier():
    for batch in (1, 2, 4, 8, 16):
        assert wm.landing_bucket_blocks("tp8-seqs16-256k.txt", batch, batch * 5) == batch * 32
        assert wm.landing_bucket_blocks("tp8-seqs16-256k-window.txt", batch, batch * 5) == batch * 5
    # A batch the file does not list pads to the next one's bucket (3 rows -> batch 4's).
    assert wm.landing_bucket_blocks("tp8-seqs16-256k-window.txt", 3, 15) == 20


def test_vllms_logged_pool_divides_by_its_sizers_reservation():
    # 2,048 full blocks + 5 sliding groups x (cdiv(511 + in-flight, 128) + 1) blocks a request.
    for in_flight, sliding in ((8192, 69), (4096, 37)):
        tokens, concurrency = wm.vllm_logged_pool(35_048, 5, in_flight)
        assert concurrency == 35_048 / (2048 + 5 * sliding)
        assert tokens == int(concurrency * 262_144)
    full_tokens, _ = wm.vllm_logged_pool(6_066, 0, 8192)
    assert full_tokens == 6_066 * 128  # a full-context cache: blocks x block size
