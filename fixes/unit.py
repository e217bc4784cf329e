"""One fix unit: a TOML data file under `units/` that says what it fixes, why, and how.

A unit edits files of one package with anchored replacements: each edit names an anchor (the
fewest lines of the target that identify the place, which must occur exactly once) and the
replacement text. The replacement carries a marker comment naming the fix, so an applied edit is
recognised by its replacement text, never by the mere absence of the anchor.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

REQUIRED_FIELDS = ("name", "package", "why", "scope", "changes", "applied_when", "remove_when", "upstream")
# Which models a unit's edits act for: "beam: <how the edited code checks it serves Beam>" or
# "global: <why it must act for every model, and the test that shows it harmless>". The runtime
# patches' index (beam_hpu/runtime/__init__.py) uses the same form.
SCOPE_KINDS = ("beam", "global")


class UnitError(Exception):
    """A unit data file is malformed (a bug in the profile data, not in the target tree)."""


@dataclass(frozen=True)
class Edit:
    file: str  # path inside the package's root directory, e.g. "vllm/v1/engine/logprobs.py"
    anchor: str
    replacement: str


@dataclass(frozen=True)
class FixUnit:
    name: str
    package: str
    why: str
    scope: str
    changes: str
    applied_when: str
    remove_when: str
    upstream: str
    edits: tuple[Edit, ...]
    source: Path

    @property
    def files(self) -> list[str]:
        return sorted({e.file for e in self.edits})


def load_unit(path: Path) -> FixUnit:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UnitError(f"{path}: {exc}") from exc
    missing = [f for f in REQUIRED_FIELDS if not str(data.get(f, "")).strip()]
    if missing:
        raise UnitError(f"{path}: missing {', '.join(missing)}")
    if data["name"] != path.stem:
        raise UnitError(f"{path}: name {data['name']!r} does not match the file name")
    problem = scope_problem(str(data["scope"]))
    if problem:
        raise UnitError(f"{path}: {problem}")
    edits = tuple(_edit(path, i, e) for i, e in enumerate(data.get("edits", []), 1))
    if not edits:
        raise UnitError(f"{path}: no edits")
    fields = {f: data[f].strip() for f in REQUIRED_FIELDS}
    return FixUnit(edits=edits, source=path, **fields)


def scope_problem(scope: str) -> str | None:
    """Why `scope` is not of the form "beam: <how>" / "global: <why, and the test>", or None."""
    kind, sep, said = scope.strip().partition(":")
    if not sep or kind not in SCOPE_KINDS:
        return f"scope must start with {' or '.join(k + ':' for k in SCOPE_KINDS)} (got {scope.strip()[:40]!r})"
    if len(said.split()) < 2:
        return f"scope '{kind}:' must say how it checks for Beam, or why it is global and what shows it harmless"
    if kind == "global" and "test" not in said:
        return "a 'global:' scope must name the test that shows it harmless"
    return None


def _edit(path: Path, index: int, raw: dict) -> Edit:
    where = f"{path} edit {index}"
    try:
        edit = Edit(file=raw["file"], anchor=raw["anchor"], replacement=raw["replacement"])
    except KeyError as exc:
        raise UnitError(f"{where}: missing {exc}") from exc
    if not edit.anchor.strip():
        raise UnitError(f"{where}: empty anchor")
    # The applied state is proved by finding the replacement; it must not also match the
    # unpatched text, or "already applied" could not be told from "not yet applied".
    if edit.replacement in edit.anchor:
        raise UnitError(f"{where}: the replacement occurs inside the anchor")
    if f"beam-hpu fix {path.stem}" not in edit.replacement:
        raise UnitError(f"{where}: the replacement lacks the marker 'beam-hpu fix {path.stem}'")
    return edit


def missing_unit(name: str, path: Path) -> FixUnit:
    """A fix the profile lists whose unit file does not exist: it has no edits and is refused."""
    return FixUnit(name=name, package="", why="", scope="", changes="", applied_when="", remove_when="",
                   upstream="", edits=(), source=path)
