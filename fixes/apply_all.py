#!/usr/bin/env python3
"""Apply a fix profile to the installed vLLM / vllm-gaudi: all fixes or none.

    python3 fixes/apply_all.py --profile v0.30.0            # apply (idempotent)
    python3 fixes/apply_all.py --profile v0.30.0 --check    # report only; never writes
    python3 fixes/apply_all.py --profile v0.30.0 --list     # what the profile holds
    python3 fixes/apply_all.py --profile v0.30.0 --explain  # --check, then where each refused
                                                            # anchor went (report only)

Exit codes: 0 every fix applied or already applied (with --check: all already applied);
1 a fix was refused or a write failed (nothing changed); 2 usage; 3 the installed trees are not
the image the profile expects (nothing changed); 4 --check found fixes not yet applied.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `fixes` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fixes.engine import EXIT_IMAGE, EXIT_OK, EXIT_USAGE, run  # noqa: E402
from fixes.explain import explain  # noqa: E402
from fixes.profile import PROFILES_DIR, ProfileError, available_profiles, load_profile  # noqa: E402


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    pairs = {}
    for value in values:
        module, sep, directory = value.partition("=")
        if not sep or not module or not directory:
            raise SystemExit(f"{flag} wants PACKAGE=DIR, got {value!r}")
        pairs[module] = directory
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", required=True,
                        help=f"profile name ({', '.join(available_profiles())})")
    parser.add_argument("--profiles-dir", type=Path, default=PROFILES_DIR,
                        help=f"where profiles are read from (default {PROFILES_DIR})")
    parser.add_argument("--check", action="store_true", help="report only, never write")
    parser.add_argument("--list", action="store_true", help="print the profile's fixes and exit")
    parser.add_argument("--explain", action="store_true",
                        help="implies --check; after the report, say where each refused anchor went "
                        "(nearest region, diff, older form of the fix); never applies a fuzzy match")
    parser.add_argument("--fix", action="append", default=[], metavar="NAME",
                        help="only this fix (repeatable; order stays the profile's)")
    parser.add_argument("--root", action="append", default=[], metavar="PACKAGE=DIR",
                        help="the directory holding PACKAGE/ (default: where Python finds it)")
    parser.add_argument("--checkout", action="append", default=[], metavar="PACKAGE=DIR",
                        help="read PACKAGE's commit from this git checkout")
    args = parser.parse_args(argv)
    try:
        profile = load_profile(args.profile, args.profiles_dir)
    except ProfileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.list:
        print(describe(profile))
        return EXIT_OK
    try:
        report = run(profile, roots=_pairs(args.root, "--root"),
                     checkouts=_pairs(args.checkout, "--checkout"), only=args.fix or None,
                     check=args.check or args.explain)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print("\n".join(report.lines))
    if args.explain:
        print("\n".join(explain_lines(profile, report, _pairs(args.checkout, "--checkout"))))
    return report.exit_code


def explain_lines(profile, report, checkouts: dict[str, str] | None = None) -> list[str]:
    if report.exit_code == EXIT_IMAGE:
        return ["explain: nothing planned (the image check refused the trees)"]
    names = [u.name for u in profile.fixes]
    out = []
    for refused in report.refused_edits:
        earlier = list(profile.fixes[:names.index(refused.fix)])
        unit = profile.fixes[names.index(refused.fix)]
        out += explain(refused, earlier, (checkouts or {}).get(unit.package)).report()
    return out or ["explain: no refused edit"]


def describe(profile) -> str:
    lines = [f"profile {profile.name}: {profile.description}"]
    for module, spec in profile.packages.items():
        version = f" {spec.version}" if spec.version else ""
        lines.append(f"  expects {module}{version} at commit {spec.commit}")
    for index, unit in enumerate(profile.fixes, 1):
        if not unit.edits:
            lines.append(f"{index:2}. {unit.name} (no unit file: always refused)")
            continue
        lines.append(f"{index:2}. {unit.name} ({unit.package}: {', '.join(unit.files)})")
        lines.append(f"    why: {unit.why}")
        lines.append(f"    scope: {unit.scope}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
