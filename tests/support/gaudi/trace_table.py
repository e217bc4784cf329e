"""The table of what Beam's forward and the DFlash2 drafter reach of vllm-gaudi and of the Habana ops,
made from the traces their tree tests record (tests/support/gaudi/trace.py), in one place: the
`tree-trace` section of beam_hpu/runtime/README.md.

    python -m tests.support.gaudi.trace_table --write          # run both tree tests, rewrite the table
    python -m tests.support.gaudi.trace_table --write --from DIR   # from traces already saved in DIR

Each tree test saves its trace when BEAM_HPU_TRACE_DIR names a folder (`keep`), and checks the
table's rows it reaches against its own trace (`differences`). The stand-in column and its citation
are read from habana_ops.py as it is now (each stand-in's docstring, or its class's), and the
card-check column from CARD_CHECK, so editing either makes the table stale until it is rewritten.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.gaudi import habana_attention, habana_ops

REPO = Path(__file__).resolve().parents[3]
README = REPO / "beam_hpu/runtime/README.md"
CARD_CHECK_README = REPO / "beam_hpu/cardcheck/README.md"
SECTION = "tree-trace"
TRACE_DIR_ENV = "BEAM_HPU_TRACE_DIR"
# Who reaches a row, and the tree test whose run records it.
# Beam: the bf16 tiny Beam's layers without the attention backend; Beam FP8: the FP8 checkpoint
# prefilled and decoded through the tree's layers and its attention backend (the served path).
REACHERS = {"Beam": "tests/model/test_tree_beam_layers.py",
            "Beam FP8": "tests/model/test_tree_beam_attention.py",
            "drafter": "tests/runtime/speculative/test_tree_dflash2_rope.py"}
HEADER = ("override or Habana op", "tree file and function",
          "stand-in (`tests/support/gaudi/habana_ops.py`, `habana_attention.py`) and the Habana source it cites",
          "reached by",
          "card-check")
# The columns a reacher's rows are compared by (besides the two that name a row).
COMPARED = ("stand-in", "card-check")

# The card-check row (beam_hpu/cardcheck/README.md's premise) that runs an override or Habana op on a
# card, by the trace's name for it; anything not here is "no". `dflash2_block` times the DFlash2
# drafter's step built on the node's layers, so its norms and RoPE run there through vllm-gaudi's
# classes and these kernels (timed, their values not compared). `cast` compares the card's
# cast_to_fp8_v2 with both rounding models; `moe` runs fp8_gemm_v2 in the gathered path and compares
# it with the fused op; `fsdpa` compares FusedSDPA tiled with one call. Not here: the MoE op.
# card-check's `moe` and `verify_rows` call torch.ops.hpu.mixture_of_experts's FP8 overload
# themselves with [2I, 1] scales, not as vllm-gaudi's MoE method calls it, and never the
# unquantised overload Beam's bf16 forward reaches (rows are named by the op, not its overload).
CARD_CHECK = {
    "HPURMSNorm.forward_oot": "dflash2_block",
    "HPURotaryEmbedding.forward_oot": "dflash2_block",
    "habana_frameworks.torch.hpex.normalization.FusedRMSNorm.apply": "dflash2_block",
    "habana_frameworks.torch.hpex.kernels.apply_rotary_pos_emb": "dflash2_block",
    "habana_frameworks.torch.hpex.kernels.FusedSDPA.apply": "fsdpa",
    "torch.ops.hpu.cast_to_fp8_v2": "cast",
    "torch.ops.hpu.fp8_gemm_v2": "moe",
}

# A Habana source as habana_ops.py cites it: a file path (a test's name after ::).
CITED_FILE = re.compile(r"(?:[\w.-]+/)*[\w.-]+\.(?:py|cpp|h)\b(?:::\w+)?")
CITED_REPO = re.compile(r"\bHabanaAI/[\w.-]+")


def card_check_rows() -> set[str]:
    return set(re.findall(r"^\| `(\w+)` \|", CARD_CHECK_README.read_text(), re.M))


def card_check(name: str) -> str:
    premise = CARD_CHECK.get(name)
    if premise is None:
        return "no"
    if premise not in card_check_rows():
        raise ValueError(f"CARD_CHECK names {premise!r} for {name}, which is no row of {CARD_CHECK_README}")
    return f"yes (`{premise}`)"


def _stand_in_doc(qualname: str) -> str:
    """The stand-in's docstring, else its class's (a method written under its class's)."""
    module = habana_ops if hasattr(habana_ops, qualname.split(".")[0]) else habana_attention
    obj, owners = module, []
    for part in qualname.split("."):
        owners.append(obj)
        obj = getattr(obj, part)
    doc = inspect.getdoc(obj) if obj.__doc__ else None
    if doc is None and len(owners) > 1 and isinstance(owners[-1], type):
        doc = inspect.getdoc(owners[-1])
    return doc or ""


def citation(qualname: str) -> str:
    """The Habana files the stand-in's docstring cites (a path wrapped over two lines joined)."""
    text = re.sub(r"/\s+", "/", " ".join(_stand_in_doc(qualname).split()))
    files = list(dict.fromkeys(CITED_FILE.findall(text)))
    if not files:
        return "cites no Habana source"
    repo = CITED_REPO.search(habana_ops.__doc__ or "")
    return f"{repo.group(0) if repo else 'Habana'}: " + ", ".join(f"`{f}`" for f in files)


def _cells(record: dict) -> tuple[str, str, str]:
    """(override or op, tree file and function, stand-in) of one trace record."""
    path, function = record["tree"].split(":", 1) if ":" in record["tree"] else (record["tree"], "")
    tree = f"`{path}` `{function}`" if function else record["tree"]
    if record["kind"] == "override":
        return f"override `{record['name']}` (vLLM's `{record['replaces']}`)", tree, "none: vllm-gaudi's own code"
    stand_ins = record["stand_ins"]
    served = "; ".join(f"`{s}`, {citation(s)}" for s in stand_ins) if stand_ins else "none ran"
    return f"Habana `{record['name']}`", tree, served


def rows(traces: dict[str, list[dict]]) -> list[tuple[str, ...]]:
    """The table's rows from each reacher's trace: overrides, then Habana ops, each by name."""
    merged: dict[tuple, tuple] = {}
    reached: dict[tuple, set] = {}
    for reacher, records in traces.items():
        for record in records:
            key = (record["kind"] != "override", record["name"], record["tree"])
            merged[key] = (*_cells(record), card_check(record["name"]))
            reached.setdefault(key, set()).add(reacher)
    order = list(REACHERS) + [r for r in traces if r not in REACHERS]
    return [(*merged[k][:3], ", ".join(sorted(reached[k], key=order.index)), merged[k][3]) for k in sorted(merged)]


def render(table_rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows]
    return "\n".join(lines) + "\n"


def _section(text: str) -> re.Match:
    found = re.search(rf"(<!-- generated:{SECTION} -->\n)(.*?)(<!-- end:{SECTION} -->)", text, re.S)
    if found is None:
        raise ValueError(f"{README} has no generated:{SECTION} section")
    return found


def committed_rows(text: str | None = None) -> list[tuple[str, ...]]:
    """The rows of the committed table (README text given, or the file)."""
    body = _section(README.read_text() if text is None else text).group(2)
    lines = [line for line in body.splitlines() if line.startswith("| ")][1:]
    return [tuple(cell.strip() for cell in line.strip()[1:-1].split(" | ")) for line in lines]


def differences(trace: list[dict], reacher: str, text: str | None = None) -> list[str]:
    """Where the committed table's rows reached by `reacher` and this run's trace differ, one line a
    row: a row only the trace has, one only the table has, or one both have with other cells."""
    def by_key(table_rows):
        return {row[:2]: row[2:3] + row[4:] for row in table_rows}

    expected = by_key(rows({reacher: trace}))
    table = by_key([row for row in committed_rows(text) if reacher in row[3].split(", ")])
    out = []
    for key in sorted(expected.keys() | table.keys()):
        if key not in table:
            out.append(f"only in this run's trace: {' | '.join(key + expected[key])}")
        elif key not in expected:
            out.append(f"only in the table: {' | '.join(key + table[key])}")
        elif expected[key] != table[key]:
            cells = [f"{column}: the table says {said}, the trace gives {given}"
                     for column, said, given in zip(COMPARED, table[key], expected[key]) if said != given]
            out.append(f"differs: {' | '.join(key)}: {'; '.join(cells)}")
    return out


def unlisted(trace: list[dict], text: str | None = None) -> list[str]:
    """The rows of a run's trace that the committed table has under no reacher, one line a row."""
    listed = {row[:2] for row in committed_rows(text)}
    return [" | ".join(row[:2]) for row in rows({"run": trace}) if row[:2] not in listed]


def keep(trace: list[dict], reacher: str) -> None:
    """Save a run's trace where `--write` collects it (only when BEAM_HPU_TRACE_DIR is set)."""
    folder = os.environ.get(TRACE_DIR_ENV)
    if folder:
        Path(folder, f"{reacher}.json").write_text(json.dumps(trace, indent=1) + "\n")


def write(folder: Path) -> list[tuple[str, ...]]:
    missing = [r for r in REACHERS if not (folder / f"{r}.json").is_file()]
    if missing:
        raise SystemExit(f"no trace from {', '.join(REACHERS[r] for r in missing)} in {folder} "
                         "(did the tree test run, or skip without a tree?)")
    table_rows = rows({r: json.loads((folder / f"{r}.json").read_text()) for r in REACHERS})
    text = README.read_text()
    found = _section(text)
    README.write_text(text[:found.start(2)] + render(table_rows) + text[found.end(2):])
    return table_rows


def run_tree_tests(folder: Path) -> None:
    """The two tree tests' trace checks (which fail while the table is stale; the traces are kept
    before they compare), in one pytest process, single worker."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-k", "trace_table", *dict.fromkeys(REACHERS.values())]
    subprocess.run(cmd, cwd=REPO, env=dict(os.environ, **{TRACE_DIR_ENV: str(folder)}, PYTHONPATH=str(REPO)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the {SECTION} section of {README}")
    parser.add_argument("--from", dest="source", type=Path,
                        help="a folder holding Beam.json and drafter.json (default: run the tree tests)")
    args = parser.parse_args(argv)
    if not args.write:
        parser.error("--write is the only action: the tree tests check the table")
    if args.source is not None:
        table_rows = write(args.source)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            run_tree_tests(Path(tmp))
            table_rows = write(Path(tmp))
    print(f"{README.relative_to(REPO)}: {len(table_rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
