"""How many of a profile's units still apply on other commits of a package, and where the refused
anchors went: the fix engine's own planner on trees taken from a git history.

    git clone --bare https://github.com/vllm-project/vllm-gaudi vllm-gaudi.git   # the history, once
    python3 benchmarks/anchor_drift.py --git-dir vllm-gaudi.git \\
        --from 091bbadd --first-parent-back 0,10,20,40,80
    python3 benchmarks/anchor_drift.py --git-dir DIR COMMIT [COMMIT ...] [--full]

For each commit the package directory is extracted with `git archive` into a temp dir and the
profile's units for that package (default: vllm_gaudi's units of port-beam-1-0-public-main, in the
profile's order) are planned in memory, without the image check (which refuses every commit but
the profile's). Prints commit, date, units that apply / units, and for each refused unit one line
from fixes/explain.py saying where its anchor went (--full: the whole report, with diffs).
Nothing is applied anywhere; the git dir is only read.
"""
from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fixes.engine import REFUSED, plan_units  # noqa: E402
from fixes.explain import explain  # noqa: E402
from fixes.profile import load_profile  # noqa: E402


def git(git_dir: str, *args: str) -> bytes:
    result = subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True)
    if result.returncode:
        raise SystemExit(f"git {' '.join(args)} in {git_dir}: {result.stderr.decode().strip()}")
    return result.stdout


def commits_to_plan(git_dir: str, commits: list[str], start: str | None, back: str | None) -> list[str]:
    if back:
        if not start:
            raise SystemExit("--first-parent-back needs --from COMMIT")
        try:
            steps = [int(n) for n in back.split(",")]
        except ValueError:
            raise SystemExit(f"--first-parent-back wants numbers like 10,20,40, got {back!r}") from None
        commits = commits + [f"{start}~{n}" for n in steps]  # ~N follows first parents
    if not commits:
        raise SystemExit("name commits, or --from COMMIT --first-parent-back N,...")
    return commits


def extract(git_dir: str, commit: str, package: str, into: Path) -> None:
    data = git(git_dir, "archive", "--format=tar", commit, package)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")


def plan_commit(git_dir: str, commit: str, units, package: str, full: bool) -> list[str]:
    sha = git(git_dir, "rev-parse", "--short=8", f"{commit}^{{commit}}").decode().strip()
    date = git(git_dir, "log", "-1", "--format=%cs", sha).decode().strip()
    with tempfile.TemporaryDirectory(prefix="anchor-drift-") as tmp:
        extract(git_dir, sha, package, Path(tmp))
        plan = plan_units(units, {package: Path(tmp)})
        applies = [u.name for u, state, _ in plan.planned if state != REFUSED]
        refused = [u.name for u, state, _ in plan.planned if state == REFUSED]
        lines = [f"{commit:>14}  {sha}  {date}  {len(applies)}/{len(units)} apply"
                 + (f"; refused: {', '.join(refused)}" if refused else "")]
        names = [u.name for u in units]
        for edit in plan.refused_edits:
            found = explain(edit, units[:names.index(edit.fix)])
            lines += ["    " + line for line in (found.report() if full else [found.summary()])]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--git-dir", required=True,
                        help="a git dir of the package's repository (bare is fine), e.g. one made by "
                        "`git clone --bare https://github.com/vllm-project/vllm-gaudi vllm-gaudi.git`")
    parser.add_argument("commits", nargs="*", help="commits to plan against")
    parser.add_argument("--from", dest="start", help="the commit --first-parent-back counts from")
    parser.add_argument("--first-parent-back", metavar="N,N,...",
                        help="also plan the first-parent commits this many steps before --from")
    parser.add_argument("--profile", default="port-beam-1-0-public-main")
    parser.add_argument("--package", default="vllm_gaudi", help="plan only this package's units")
    parser.add_argument("--full", action="store_true", help="the whole explain report per refusal")
    args = parser.parse_args(argv)
    units = [u for u in load_profile(args.profile).fixes if u.package == args.package and u.edits]
    if not units:
        raise SystemExit(f"profile {args.profile} has no units for package {args.package}")
    print(f"profile {args.profile}: {len(units)} {args.package} units, planned without the image check")
    for commit in commits_to_plan(args.git_dir, args.commits, args.start, args.first_parent_back):
        print("\n".join(plan_commit(args.git_dir, commit, units, args.package, args.full)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
