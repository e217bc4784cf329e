"""`beam-hpu card-check [--quick] [--cpu] [--out DIR] [--model PATH] [--switch NAME ...]`: the engine
A/B of every switch (engine_ab.py), then every premise row as a diagnostic, a verdict per switch
printed with its figures; DIR gets card-check.json and the report a person reads (card-check.md
with a plot, report.py)."""

from __future__ import annotations

import json
import platform
from dataclasses import asdict
from pathlib import Path

from beam_hpu.cardcheck import engine_ab, premises, report as report_writer, synthetic, verdicts
from beam_hpu.cardcheck.device import detect
from beam_hpu.runtime.prefill.hpu_fsdpa_tiles import fsdpa_tile_switches

DEFAULT_OUT = "card-check"
JSON_NAME = "card-check.json"


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="small premise shapes (seconds; what CPU runs need)")
    parser.add_argument("--cpu", action="store_true", help="measure on this host's CPU even where a card is present")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"the folder for {JSON_NAME}, {report_writer.REPORT} and its plot (default ./{DEFAULT_OUT})")
    parser.add_argument("--model", help="the checkpoint the engine A/B serves (on the node: the served one, "
                                        "default a 4-layer Beam of the published shapes with random weights; "
                                        "on CPU: the tiny trained Beam quantised to FP8)")
    parser.add_argument("--drafter", help="the DFlash2 drafter for the speculative setting (default: the tiny one)")
    parser.add_argument("--switch", action="append", dest="switches", metavar="NAME",
                        choices=engine_ab.SWITCH_NAMES,
                        help="A/B only this switch (repeatable; default: every switch)")


def _engine_verdicts(device, out: Path, model: str | None, switches, drafter, echo) -> tuple[list, dict]:
    if model:
        model_path = Path(model)
    elif device.on_card:  # no checkpoint on the node: Beam's published shapes, fewer layers
        model_path = synthetic.write_synthetic(out / "synthetic-beam")
    else:
        model_path = engine_ab.cpu_model(out)
    workload = engine_ab.NODE if device.on_card else engine_ab.CPU
    found = []
    for ab, runs in engine_ab.run_switches(device.name, model_path, workload, switches, drafter, out, echo):
        verdict = verdicts.engine_switch(ab.switch, ab.kind, runs, acts_here=device.name in ab.acts_on)
        for setting in ab.settings:
            verdict.figures[setting.name]["setting"] = {"env": setting.env, "speculative": setting.speculative}
        found.append(verdict)
        echo(f"{verdict.switch}: {verdict.verdict} ({verdict.why}) [{device.label}]")
    context = {"model": str(model_path), "workload": asdict(workload)}
    if engine_ab.is_synthetic(model_path) and found:
        recipe = next(iter(v for v in found[0].figures.values() if isinstance(v, dict)))
        context["extrapolated_to_52_layers"] = {
            "label": synthetic.EXTRAPOLATION,
            "recipe_decode_step_ms": {b: synthetic.extrapolate_step_ms(ms) for b, ms in recipe["step_ms"].items()}}
    return found, context


def _measured(engine: list) -> tuple[float | None, float | None]:
    """(the recipe engine's batch-1 decode step, DFlash2's measured accepted length) from the A/B."""
    step = accepted = None
    for verdict in engine:
        runs = [f for f in verdict.figures.values() if isinstance(f, dict)]
        if step is None and runs and "step_ms" in runs[0]:
            step = runs[0]["step_ms"].get(1)
        if verdict.switch.startswith("--speculative-config") and len(runs) > 1:
            accepted = runs[1].get("accepted_length")
    return step, accepted


def run(quick: bool, force_cpu: bool, out: Path, model: str | None = None, switches: list[str] | None = None,
        drafter: str | None = None, echo=print) -> dict:
    device = detect(force_cpu)
    out.mkdir(parents=True, exist_ok=True)
    shapes = premises.QUICK if quick else premises.FULL
    drafter_shapes = premises.QUICK_DRAFTER if quick else premises.FULL_DRAFTER
    q_tile, ws_gib = fsdpa_tile_switches()
    if not q_tile or not ws_gib:
        q_tile, ws_gib = premises.RECIPE_Q_TILE, premises.RECIPE_WS_GIB
    if quick:  # small shapes fit any bound: a small one makes the rule tile, so both paths are timed
        ws_gib = min(ws_gib, 0.001)
    echo(f"card-check on {device.name} ({device.label}), {'quick' if quick else 'Beam'} premise shapes")
    engine, context = _engine_verdicts(device, out, model, switches, drafter, echo)
    step_ms, accepted = _measured(engine)
    steps = [("moe", lambda: premises.moe(device, shapes)), ("cast", lambda: premises.cast(device, shapes)),
             ("storage", lambda: premises.storage(device, shapes)),
             ("fsdpa", lambda: premises.fsdpa(device, shapes, q_tile, ws_gib)),
             ("verify", lambda: premises.verify(device, shapes)),
             ("window_kv", lambda: premises.window_kv(device, shapes, step_ms)),
             ("verify_rows", lambda: premises.verify_rows(device, shapes)),
             ("dflash2_block", lambda: premises.dflash2_block(device, shapes, drafter_shapes)),
             # from the two rows before it and the engine A/B's accepted length: nothing of its own
             ("dflash2", lambda: verdicts.dflash2_gain(by["verify_rows"].figures["ms_by_rows"],
                                                        by["dflash2_block"].figures["ms_by_batch"], accepted))]
    report = {"device": device.name, "label": device.label, "host": platform.node(), "quick": quick, **context,
              "fsdpa_switches": {"BEAM_FSDPA_Q_TILE": q_tile, "BEAM_FSDPA_WS_GIB": ws_gib},
              "verdicts": [v.as_dict() for v in engine]}
    by = {}
    for name, measure in steps:
        echo(f"  measuring {name} ...")
        verdict = by[name] = measure()
        report["verdicts"].append(verdict.as_dict())
        echo(f"{verdict.switch}: {verdict.verdict} ({verdict.why}) [{device.label}]")
    json_path = out / JSON_NAME
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    text, plot = report_writer.write(report, out)
    echo(f"written {json_path}, {text}, {plot}")
    return report


def run_cli(args) -> int:
    run(args.quick, args.cpu, Path(args.out), args.model, args.switches, args.drafter)
    return 0
