"""`beam-hpu card-check [--quick] [--cpu] [--out FILE]`: every premise measured in turn, a verdict
per switch printed with its figures, all of it written as JSON (default ./card-check.json)."""

from __future__ import annotations

import json
import platform
from pathlib import Path

from beam_hpu.cardcheck import premises, verdicts
from beam_hpu.cardcheck.device import detect
from beam_hpu.runtime.prefill.hpu_fsdpa_tiles import fsdpa_tile_switches

DEFAULT_OUT = "card-check.json"


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="small shapes (seconds; what CPU runs need)")
    parser.add_argument("--cpu", action="store_true", help="measure on this host's CPU even where a card is present")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"the JSON report (default ./{DEFAULT_OUT})")


def run(quick: bool, force_cpu: bool, out: Path, echo=print) -> dict:
    device = detect(force_cpu)
    shapes = premises.QUICK if quick else premises.FULL
    drafter = premises.QUICK_DRAFTER if quick else premises.FULL_DRAFTER
    q_tile, ws_gib = fsdpa_tile_switches()
    if not q_tile or not ws_gib:
        q_tile, ws_gib = premises.RECIPE_Q_TILE, premises.RECIPE_WS_GIB
    if quick:  # small shapes fit any bound: a small one makes the rule tile, so both paths are timed
        ws_gib = min(ws_gib, 0.001)
    echo(f"card-check on {device.name} ({device.label}), {'quick' if quick else 'Beam'} shapes")
    steps = [("moe", lambda: premises.moe(device, shapes)), ("cast", lambda: premises.cast(device, shapes)),
             ("storage", lambda: premises.storage(device, shapes)),
             ("fsdpa", lambda: premises.fsdpa(device, shapes, q_tile, ws_gib)),
             ("verify", lambda: premises.verify(device, shapes)),
             ("window_kv", lambda: premises.window_kv(device, shapes)),
             ("verify_rows", lambda: premises.verify_rows(device, shapes)),
             ("dflash2_block", lambda: premises.dflash2_block(device, shapes, drafter)),
             # from the two rows before it: nothing measured of its own
             ("dflash2", lambda: verdicts.dflash2_gain(by["verify_rows"].figures["ms_by_rows"],
                                                        by["dflash2_block"].figures["ms_by_batch"]))]
    report = {"device": device.name, "label": device.label, "host": platform.node(), "quick": quick,
              "fsdpa_switches": {"BEAM_FSDPA_Q_TILE": q_tile, "BEAM_FSDPA_WS_GIB": ws_gib}, "verdicts": []}
    by = {}
    for name, measure in steps:
        echo(f"  measuring {name} ...")
        verdict = by[name] = measure()
        report["verdicts"].append(verdict.as_dict())
        echo(f"{verdict.switch}: {verdict.verdict} ({verdict.why}) [{device.label}]")
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    echo(f"written {out}")
    return report


def run_cli(args) -> int:
    run(args.quick, args.cpu, Path(args.out))
    return 0
