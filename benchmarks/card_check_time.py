"""A MODEL (not a measurement) of how long `beam-hpu card-check --out DIR` takes on the node when it
serves the synthetic Beam (4 layers of the published shapes, dummy weights): the engine A/B's
starts and what each start serves, from card-check's own tables, times per-start costs that only
a node can measure.

Counted from the code (printed): the engine starts (the recipe's setting once, every other
setting once, a warm setting twice: engine_ab.ab_switches over serving/recipe.yaml), and per start
the requests engine_run.py sends (per batch two runs of a prompt and NODE.decode_steps decode
steps; where TTFT is measured, 1 + TTFT_REPEATS prompts per context) and the graphs those meet: the
buckets of the recipe's bucket file that its prompt chunks (max-num-batched-tokens each) and decode
batches land in, each compiled once per start. The DFlash2 setting's own bucket file and drafter
graphs are counted as the recipe's (its verify buckets are the same decode batches).

Assumed (printed, each with the card figure that replaces it):
- a start's own cost (8 ranks, HCCL, dummy weights of 4 layers, the profile run, the KV cache):
  START_S; the node's card-check.json `engine_start_ms` replaces it;
- one graph's compilation: COMPILE_S; the node report's `compile_ms` per batch replaces it;
- a decode step of the 4-layer Beam: the recipe's measured 52-layer step (1 stream 29 tok/s), not
  scaled down, because decode is bound by host graph launches (the recipe's Performance note);
  the node report's `step_ms` replaces it;
- prefill: the recipe's measured copy test (129,938 tokens end to end in 34.5 s) scaled by 4/52
  layers, because a long prompt's chunks are compute-bound; the node report's `ttft_ms` replaces it;
- the premise rows: PREMISES_S.

With `--cpu-report card-check.json` (a CPU run's `--out`), it also prints what that run took per
start, for comparison (a CPU start serves a 2-layer tiny Beam: no graph compiles, no ranks).

Run: python benchmarks/card_check_time.py [--start-s 150] [--compile-s 6] [--premises-s 120]
     [--budget-min 30] [--cpu-report DIR/card-check.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from beam_hpu.cardcheck import engine_ab  # noqa: E402
from beam_hpu.cardcheck.engine_run import TTFT_REPEATS  # noqa: E402
from beam_hpu.cardcheck.synthetic import PUBLISHED_LAYERS, SYNTHETIC_LAYERS  # noqa: E402
from serving.lint_buckets import first_holding, parse_bucket_text  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
START_S = 90.0
COMPILE_S = 6.0
PREMISES_S = 120.0
RECIPE_ONE_STREAM_TOK_S = 29.0  # the recipe's Performance table: 28.5 to 29.5
RECIPE_COPY_TOKENS, RECIPE_COPY_S = 129_938, 34.5  # the recipe's copy test, end to end


def starts(recipe: dict) -> list[tuple[str, engine_ab.Workload]]:
    """Every engine start of a full run and the workload it serves, as run_switches does it."""
    out = [("recipe", engine_ab.NODE)]
    for ab in engine_ab.ab_switches(recipe):
        for setting in ab.settings[1:]:
            workload = engine_ab.setting_workload(ab, engine_ab.NODE)
            out += [(f"{ab.switch} = {setting.name}", workload)] * (2 if setting.warm else 1)
    return out


def graphs_met(workload: engine_ab.Workload, buckets: list[tuple[int, int, int]], block: int, chunk: int) -> set:
    """The bucket-file graphs one start's requests land in: each prompt chunk (query tokens, context
    blocks before it) in the first prompt bucket holding it, each decode batch in the first decode
    bucket holding its blocks (vllm-gaudi's lookup: serving/lint_buckets.first_holding)."""
    prompts = sorted(b for b in buckets if b[1] > 1)
    decodes = sorted(b for b in buckets if b[1] == 1)
    met = set()

    def prompt(tokens: int) -> None:
        for done in range(0, tokens, chunk):
            q, ctx = min(chunk, tokens - done), done // block
            met.add(next(b for b in prompts if b[1] >= q and b[2] >= ctx))

    for batch in workload.batches:
        prompt(workload.prompt_len)  # one sequence a prompt step: batch-1 prompt buckets
        blocks = batch * math.ceil((workload.prompt_len + workload.decode_steps) / block)
        met.add(first_holding(decodes, batch, blocks))
    for context in workload.contexts:
        prompt(context)
    return met


def per_start(workload: engine_ab.Workload, graphs: int, start_s: float, compile_s: float) -> dict:
    step_s = 1 / RECIPE_ONE_STREAM_TOK_S
    prefill_tok_s = RECIPE_COPY_TOKENS / RECIPE_COPY_S * PUBLISHED_LAYERS / SYNTHETIC_LAYERS
    decode_s = sum(2 * (b * workload.prompt_len / prefill_tok_s + workload.decode_steps * step_s)
                   for b in workload.batches)
    ttft_s = sum((1 + TTFT_REPEATS) * c / prefill_tok_s for c in workload.contexts)
    return {"graphs": graphs, "start_s": start_s, "compile_s": graphs * compile_s, "decode_s": decode_s,
            "ttft_s": ttft_s, "total_s": start_s + graphs * compile_s + decode_s + ttft_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--start-s", type=float, default=START_S)
    parser.add_argument("--compile-s", type=float, default=COMPILE_S)
    parser.add_argument("--premises-s", type=float, default=PREMISES_S)
    parser.add_argument("--budget-min", type=float, default=30.0)
    parser.add_argument("--cpu-report", type=Path)
    args = parser.parse_args(argv)
    recipe_module = engine_ab.cookbook_recipe()
    recipe = recipe_module.load_recipe()
    chunk, block = int(recipe["serve"]["max-num-batched-tokens"]), int(recipe["serve"]["block-size"])
    bucket_file = REPO / "serving" / Path(recipe["env"]["VLLM_BUCKETING_FROM_FILE"]).name
    buckets = [b.shape for b in parse_bucket_text(bucket_file.read_text())[0]]
    runs = [(name, workload, len(graphs_met(workload, buckets, block, chunk))) for name, workload in starts(recipe)]
    print("MODEL, not a measurement: card-check's engine A/B on the node with the synthetic Beam")
    print(f"  counted: {len(runs)} engine starts (serving/recipe.yaml's switches); workload {engine_ab.NODE}; "
          f"graphs a start meets from {bucket_file.relative_to(REPO)} (prompt chunks of {chunk} tokens, blocks of "
          f"{block}); TTFT repeats 1 + {TTFT_REPEATS}")
    print(f"  assumed: start {args.start_s:.0f} s [node card-check.json engine_start_ms]; "
          f"{args.compile_s:.0f} s per graph [compile_ms]; decode step {1e3 / RECIPE_ONE_STREAM_TOK_S:.1f} ms, "
          f"the recipe's 52-layer step, host-bound so not scaled [step_ms]; prefill "
          f"{RECIPE_COPY_TOKENS / RECIPE_COPY_S:.0f} tok/s (the recipe's copy test) x {PUBLISHED_LAYERS}/"
          f"{SYNTHETIC_LAYERS} layers [ttft_ms]; premise rows {args.premises_s:.0f} s")
    total = args.premises_s
    print(f"\n{'engine start':52} {'graphs':>6} {'start':>6} {'compile':>8} {'decode':>7} {'TTFT':>6} {'total s':>8}")
    for name, workload, graphs in runs:
        f = per_start(workload, graphs, args.start_s, args.compile_s)
        total += f["total_s"]
        print(f"{name:52} {f['graphs']:6d} {f['start_s']:6.0f} {f['compile_s']:8.0f} {f['decode_s']:7.1f} "
              f"{f['ttft_s']:6.1f} {f['total_s']:8.0f}")
    budget = args.budget_min * 60
    print(f"\nwhole run: {total / 60:.1f} min (MODEL) against a budget of {args.budget_min:.0f} min")
    fixed = sum(per_start(w, g, 0.0, 0.0)["total_s"] for _, w, g in runs) + args.premises_s
    graphs = sum(g for _, _, g in runs)
    print(f"  it stays within budget while start x {len(runs)} + compile x {graphs} graphs <= "
          f"{budget - fixed:.0f} s (at {args.compile_s:.0f} s a graph: a start of up to "
          f"{max(budget - fixed - graphs * args.compile_s, 0) / len(runs):.0f} s)")
    if args.cpu_report:
        report = json.loads(args.cpu_report.read_text())
        engine = [v for v in report["verdicts"] if v["premise"] == "engine"]
        measured = [f["start_to_first_token_ms"] / 1e3 for v in engine for f in v["figures"].values()
                    if isinstance(f, dict) and f.get("start_to_first_token_ms")]
        if measured:
            print(f"  the CPU report ({report['label']}): engine start to first token "
                  f"{min(measured):.1f} to {max(measured):.1f} s a start over {len(measured)} settings")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
