"""Plan every fix of a profile against the trees, then write all of it or none of it.

Each edit is in one of three states, decided on the text as the earlier fixes left it:
applied (its replacement, which carries the fix's marker, occurs exactly once), applicable (its
anchor occurs exactly once and the replacement not at all), or refused (anything else: anchor
missing or ambiguous). A fix whose edits disagree (some applied, some not) is refused.
"""
from __future__ import annotations

import ast
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from fixes.image import ImageError, InstalledPackage, check_package, inspect_package, locate_root
from fixes.profile import DEFAULT_STAMP, Profile
from fixes.transaction import WriteError, read_text, unwritable_reason, write_all
from fixes.unit import Edit, FixUnit

STAMP_NAME = DEFAULT_STAMP

EXIT_OK = 0
EXIT_REFUSED = 1  # a fix could not be applied, or writing failed: nothing was changed
EXIT_USAGE = 2
EXIT_IMAGE = 3  # the trees are not the image the profile expects: nothing was changed
EXIT_NOT_APPLIED = 4  # --check: some fix is not applied (or the stamp does not record it)

APPLIED, ALREADY, REFUSED, WOULD_APPLY = "applied", "already applied", "refused", "not applied"


@dataclass(frozen=True)
class RefusedEdit:
    """An edit the plan refused, with the text it was checked against (what --explain reads)."""
    fix: str
    index: int  # 1-based, in the unit's edits
    edit: Edit
    root: Path  # the directory holding the package
    text: str | None  # as the plan had it (earlier fixes and edits applied); None: no file
    why: str
    on_disk: str | None = None  # the file as it is: line numbers for the operator come from it


@dataclass
class Plan:
    texts: dict[Path, str]  # every target file as the plan leaves it
    originals: dict[Path, str]
    planned: list[tuple[FixUnit, str, str]]  # (unit, state, why), in profile order
    refused_edits: list[RefusedEdit]


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    states: dict[str, str] = field(default_factory=dict)  # fix name -> state
    exit_code: int = EXIT_OK
    refused_edits: list[RefusedEdit] = field(default_factory=list)

    def fix(self, name: str, state: str, why: str = "") -> None:
        self.states[name] = state
        self.lines.append(f"{name}: {state}" + (f": {why}" if why else ""))


def run(profile: Profile, roots: dict[str, str] | None = None,
        checkouts: dict[str, str] | None = None, only: list[str] | None = None,
        check: bool = False) -> Report:
    roots, checkouts = roots or {}, checkouts or {}
    units = _select(profile, only)
    report = Report()
    try:
        # The whole profile checks the whole image; a --fix subset only the packages it touches.
        needed = set(profile.packages) if not only else {u.package for u in units if u.edits}
        installed = _check_image(profile, needed, roots, checkouts, report)
    except ImageError as exc:
        report.lines.append(f"image: refused: {exc}")
        for unit in units:
            report.fix(unit.name, REFUSED, "image check failed")
        report.exit_code = EXIT_IMAGE
        return report

    plan = plan_units(units, {module: pkg.root for module, pkg in installed.items()})
    texts, originals, planned = plan.texts, plan.originals, plan.planned
    report.refused_edits = plan.refused_edits
    changed = {p: t for p, t in texts.items() if t != originals[p]}
    broken = _unparsable(changed)
    stamps = _stamps(profile, units, installed, texts, planned)
    if check:
        return _report_check(report, planned, stamps)

    to_write = dict(changed)
    to_write.update({path: text for path, (text, current) in stamps.items() if text != current})
    blocked = {p: r for p in to_write if (r := _unwritable(p))}
    results = []
    for unit, state, why in planned:
        paths = [installed[unit.package].root / f for f in unit.files] if unit.edits else []
        problems = [broken[p] for p in paths if p in broken] + [blocked[p] for p in paths if p in blocked]
        if state != REFUSED and problems:
            state, why = REFUSED, problems[0]
        results.append((unit.name, state, why))
    refused = blocked or any(state == REFUSED for _, state, _ in results)
    if not refused and to_write:
        try:
            write_all(to_write)
        except WriteError as exc:
            results = [(n, REFUSED, "write failed, nothing changed") if s == APPLIED else (n, s, w)
                       for n, s, w in results]
            report.lines.append(f"write failed: {exc}")
            refused = True
    if refused:  # nothing is written, so nothing is "applied"
        results = [(n, WOULD_APPLY, "nothing was written") if s == APPLIED else (n, s, w)
                   for n, s, w in results]
    for name, state, why in results:
        report.fix(name, state, why)
    if refused:
        for path in stamps:
            if path in blocked:
                report.lines.append(f"stamp: refused: {blocked[path]}")
        report.lines.append("nothing was written")
        report.exit_code = EXIT_REFUSED
        return report
    for path, (text, current) in stamps.items():
        report.lines.append(f"stamp: {path} " + ("unchanged" if text == current else "written"))
    return report


def _select(profile: Profile, only: list[str] | None) -> list[FixUnit]:
    if not only:
        return list(profile.fixes)
    names = {u.name for u in profile.fixes}
    unknown = [n for n in only if n not in names]
    if unknown:
        raise ValueError(f"profile {profile.name} has no fix {', '.join(unknown)}")
    return [u for u in profile.fixes if u.name in only]  # always in the profile's order


def _check_image(profile: Profile, needed: set[str], roots: dict[str, str],
                 checkouts: dict[str, str], report: Report) -> dict[str, InstalledPackage]:
    installed, problems = {}, []
    for module in sorted(needed):
        spec = profile.packages[module]
        pkg = inspect_package(spec, locate_root(module, roots.get(module)), checkouts.get(module))
        report.lines.append(f"image: {pkg.describe()}")
        problem = check_package(spec, pkg)
        if problem:
            problems.append(problem)
        installed[module] = pkg
    if problems:
        raise ImageError("; ".join(problems))
    return installed


def plan_units(units: list[FixUnit], roots: dict[str, Path]) -> Plan:
    """Plan the units in order on the trees (package -> directory holding it), in memory only.
    No image check: run() does that first; benchmarks/anchor_drift.py plans other commits."""
    plan = Plan({}, {}, [], [])
    for unit in units:
        if unit.edits and unit.package not in roots:
            plan.planned.append((unit, REFUSED, f"no tree given for package {unit.package}"))
            continue
        root = Path(roots[unit.package]) if unit.edits else Path()
        state, why = _plan_unit(unit, root, plan.texts, plan.originals, plan.refused_edits)
        plan.planned.append((unit, state, why))
    return plan


def _plan_unit(unit: FixUnit, root: Path, texts: dict[Path, str], originals: dict[Path, str],
               refused_edits: list[RefusedEdit]) -> tuple[str, str]:
    if not unit.edits:
        return REFUSED, f"no unit file {unit.source.name} for this fix"
    scratch: dict[Path, str] = {}
    states = []
    first_refusal = None  # the unit is refused on it; later edits are still checked, for --explain
    for index, edit in enumerate(unit.edits, 1):
        path = root / edit.file
        if path not in texts:
            if not path.is_file():
                why = f"{edit.file}: no such file in {root}"
                refused_edits.append(RefusedEdit(unit.name, index, edit, root, None, why, None))
                first_refusal = first_refusal or why
                continue
            texts[path] = originals[path] = read_text(path)
        text = scratch.get(path, texts[path])
        state, why = _edit_state(edit, text)
        if state == REFUSED:
            refused_edits.append(RefusedEdit(unit.name, index, edit, root, text, why, originals[path]))
            first_refusal = first_refusal or f"{edit.file} (edit {index}): {why}"
            continue
        if state == APPLIED:
            text = text.replace(edit.anchor, edit.replacement, 1)
        scratch[path] = text
        states.append(state)
    if first_refusal:
        return REFUSED, first_refusal
    if len(set(states)) > 1:
        done = [str(i) for i, s in enumerate(states, 1) if s == ALREADY]
        return REFUSED, f"partly applied (edit {', '.join(done)} of {len(states)} found applied)"
    texts.update(scratch)
    return states[0], ""


def _edit_state(edit: Edit, text: str) -> tuple[str, str]:
    new, old = text.count(edit.replacement), text.count(edit.anchor)
    if new == 1 and (old == 0 or edit.anchor in edit.replacement):
        return ALREADY, ""
    if new == 0 and old == 1:
        return APPLIED, ""
    if new == 0 and old == 0:
        return REFUSED, "anchor not found (the target has changed)"
    return REFUSED, f"anchor found {old} times, replacement {new} times (expected exactly one)"


def _unparsable(changed: dict[Path, str]) -> dict[Path, str]:
    broken = {}
    for path, text in changed.items():
        if path.suffix == ".py":
            try:
                ast.parse(text, filename=str(path))
            except SyntaxError as exc:
                broken[path] = f"the patched {path.name} would not parse: line {exc.lineno}: {exc.msg}"
    return broken


def _unwritable(path: Path) -> str | None:
    if path.exists():
        return unwritable_reason(path)
    return unwritable_reason(path.parent)  # a new stamp: its directory must take it


def _stamps(top: Profile, units: list[FixUnit], installed: dict[str, InstalledPackage],
            texts: dict[Path, str], planned) -> dict[Path, tuple[str, str | None]]:
    """Per package and per profile of the chain (a layered profile and its bases): (the stamp
    the tree should carry after this run, the stamp it carries now). A layer rewrites its
    base's stamp too: the base's fixes stay applied, but the files it hashed have changed."""
    stamps = {}
    for profile in top.chain():
        mine = {u.name for u in profile.fixes}
        stamps.update(_profile_stamps(profile, [u for u in units if u.name in mine], installed, texts,
                                      [p for p in planned if p[0].name in mine]))
    return stamps


def _profile_stamps(profile: Profile, units: list[FixUnit], installed: dict[str, InstalledPackage],
                    texts: dict[Path, str], planned) -> dict[Path, tuple[str, str | None]]:
    ok = {u.name for u, state, _ in planned if state != REFUSED}
    stamps = {}
    for module, pkg in installed.items():
        path = pkg.root / module / profile.stamp
        current = read_text(path) if path.is_file() else None
        previous = _parse_stamp(current)
        done = set(previous.get("fixes", [])) if previous.get("profile") == profile.name else set()
        done |= {u.name for u in units if u.package == module and u.name in ok}
        files = sorted({f for u in profile.fixes if u.name in done for f in u.files})
        stamp = {
            "profile": profile.name,
            "written_by": "beam-hpu fixes/apply_all.py",
            "commit": pkg.commit,
            "fixes": [u.name for u in profile.fixes if u.name in done],
            "files": {f: _sha256(texts.get(pkg.root / f) or read_text(pkg.root / f)) for f in files},
        }
        stamps[path] = (json.dumps(stamp, indent=2) + "\n", current)
    return stamps


def _parse_stamp(text: str | None) -> dict:
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _report_check(report: Report, planned, stamps) -> Report:
    for unit, state, why in planned:
        report.fix(unit.name, WOULD_APPLY if state == APPLIED else state, why)
    all_applied = all(state == ALREADY for _, state, _ in planned)
    for path, (text, current) in stamps.items():
        if all_applied and text != current:
            report.lines.append(f"stamp: {path} " + ("missing" if current is None else "stale"))
            all_applied = False
    report.exit_code = EXIT_OK if all_applied else (
        EXIT_REFUSED if any(s == REFUSED for _, s, _ in planned) else EXIT_NOT_APPLIED)
    return report
