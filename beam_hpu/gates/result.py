"""A gate's outcome, the Markdown table and the JSON report."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class GateResult:
    gate: str
    passed: bool
    result: str  # one line, like the recipe's "Result" column
    details: dict = field(default_factory=dict)
    seconds: float = 0.0


def table(results: list[GateResult]) -> str:
    lines = ["| Gate | Result | Pass |", "|---|---|---|"]
    for r in results:
        lines.append(f"| {r.gate} | {r.result.replace('|', '/')} | {'PASS' if r.passed else 'FAIL'} |")
    return "\n".join(lines)


def write_json(results: list[GateResult], path: str | Path, meta: dict) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "passed": all(r.passed for r in results),
                                      "gates": [asdict(r) for r in results]}, indent=2, default=str) + "\n")
