"""Where a refused anchor went: a report for the operator, never a patch.

For an edit the plan refused (anchor not found, found more than once, or its replacement found
where it should not be), say what the target holds instead: every place the anchor occurs; when
it occurs nowhere, the most similar region of the target file (difflib's ratio over windows of the
anchor's length, indentation ignored) with a unified diff of anchor vs region, the anchor's exact
occurrences in the package's other files, and, when nothing in the target is close or the file is
gone, their most similar region; anchor lines that only an earlier fix writes; and whether an
older form of this fix is there (its marker `beam-hpu fix NAME` around different text). When the
target is in a git checkout (the package root, or `--checkout`), each similar region names the
newest commit of the checkout's first-parent line that changed it: on a release branch the
squash-merged PR "... (#N)", on a tree built by merging PRs the merge of that PR.

Nothing here changes a file or decides that a fuzzy match is good enough: the engine applies an
edit only when its anchor occurs exactly once, and this module only describes why it did not.
"""
from __future__ import annotations

import ast
import difflib
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from fixes.engine import RefusedEdit
from fixes.unit import FixUnit

# Below this ratio the nearest region in the target file is too weak to call the anchor edited
# there: the package's other files are searched too, and the summary says "no close match".
CLOSE = 0.75


@dataclass(frozen=True)
class Region:
    file: str  # relative to the directory holding the package
    first: int  # 1-based line numbers, inclusive
    last: int
    ratio: float  # 1.0 for an exact occurrence
    text: str
    scope: str  # the enclosing class/function ("" at module level or when it does not parse)

    def place(self) -> str:
        lines = f"{self.first}" if self.first == self.last else f"{self.first}-{self.last}"
        return f"{self.file}:{lines}" + (f" (in {self.scope})" if self.scope else "")


@dataclass
class Explanation:
    fix: str
    index: int
    file: str
    why: str
    occurrences: list[Region] = field(default_factory=list)  # exact, in the target file
    nearest: Region | None = None  # most similar region when the anchor occurs nowhere there
    runners_up: list[Region] = field(default_factory=list)  # the next most similar ones there
    elsewhere: list[Region] = field(default_factory=list)  # other files of the package
    written_by: dict[str, list[str]] = field(default_factory=dict)  # fix -> anchor lines it writes
    markers: list[Region] = field(default_factory=list)  # lines carrying this fix's marker
    replacements: list[Region] = field(default_factory=list)  # exact replacement occurrences
    older: Region | None = None  # the region most like this edit's replacement (markers found)
    anchor: str = ""
    replacement: str = ""
    missing: bool = False  # the target file does not exist
    changed_by: dict[str, str] = field(default_factory=dict)  # region place -> newest commit there

    def summary(self) -> str:
        """One line: where the anchor went."""
        head = f"{self.fix} edit {self.index}: " + (f"no file {self.file}; " if self.missing else "")
        if self.written_by:
            names = ", ".join(sorted(self.written_by))
            head += f"anchor needs text written by {names}; "
        if len(self.occurrences) > 1:
            places = "; ".join(r.place() for r in self.occurrences)
            return head + f"anchor found {len(self.occurrences)} times: {places}"
        if self.replacements and self.occurrences:
            return head + "anchor found once and its replacement too: " + "; ".join(
                r.place() for r in self.replacements)
        if self.markers and self.older is not None:
            head += f"older form of the fix at {self.older.place()} ratio {self.older.ratio:.2f}; "
        moved = [r for r in self.elsewhere if r.ratio == 1.0]
        if moved:
            return head + "anchor moved to " + "; ".join(r.place() for r in moved)
        best = self.best()
        if best is None:
            return head + f"{self.why}; nothing similar in the package"
        if best.ratio < CLOSE:
            return head + f"anchor not found, no close match (best {best.place()} ratio {best.ratio:.2f})"
        head += f"anchor not found; nearest {best.place()} ratio {best.ratio:.2f}"
        if best is self.nearest and self.runners_up:
            head += " (next: " + "; ".join(f"{r.first}-{r.last} {r.ratio:.2f}" for r in self.runners_up) + ")"
        return head

    def _changed(self, region: Region) -> list[str]:
        by = self.changed_by.get(region.place())
        return [f"    last changed there by: {by}"] if by else []

    def best(self) -> Region | None:
        candidates = [r for r in [self.nearest, *self.elsewhere] if r is not None]
        return max(candidates, key=lambda r: r.ratio, default=None)

    def report(self) -> list[str]:
        """The full report: places, the diff of anchor vs the nearest region, the older form."""
        out = [f"explain {self.fix} edit {self.index} ({self.file}): {self.why}"]
        for name, lines in sorted(self.written_by.items()):
            out.append(f"  the anchor's lines {', '.join(repr(x) for x in lines)} are written by fix "
                       f"{name}, which did not apply here")
        if len(self.occurrences) > 1:
            out += [f"  anchor at {r.place()}" for r in self.occurrences]
        for region in self.replacements:
            out.append(f"  replacement at {region.place()}")
        for region in self.elsewhere:
            kind = "anchor moved to" if region.ratio == 1.0 else "similar region in another file:"
            out.append(f"  {kind} {region.place()} ratio {region.ratio:.2f}")
        best = self.best()
        if best is not None and len(self.occurrences) != 1 and best.ratio < 1.0:
            out.append(f"  most similar region: {best.place()} ratio {best.ratio:.2f}"
                       + (" (weak: the anchor's text may be gone)" if best.ratio < CLOSE else ""))
            out += ["    " + line for line in _diff(self.anchor, best, "anchor")]
            out += self._changed(best)
            for region in self.runners_up:
                out.append(f"  next most similar in the target: {region.place()} ratio {region.ratio:.2f}")
                out += self._changed(region)
        elif best is None and not self.occurrences:
            out.append("  no similar region in the target file or the package")
        if self.markers:
            out.append(f"  marker 'beam-hpu fix {self.fix}' present at "
                       + ", ".join(r.place() for r in self.markers)
                       + ": an older or partial form of this fix is in the file")
            if self.older is not None:
                out.append(f"  closest to this edit's replacement: {self.older.place()} "
                           f"ratio {self.older.ratio:.2f}")
                out += ["    " + line for line in _diff(self.replacement, self.older, "replacement")]
        else:
            out.append(f"  no marker 'beam-hpu fix {self.fix}' in {self.file}: no older form of this fix")
        out.append("  (report only: nothing was changed, and a similar region is never applied)")
        return out


def explain(refused: RefusedEdit, earlier: list[FixUnit] = (), checkout: str | None = None) -> Explanation:
    """Describe one refused edit. `earlier`: the units planned before it (a line of the anchor
    that the planned text lacks and one of their replacements has shows the anchor depends on
    them). Places are looked for in the file as it is on disk, so their line numbers are the
    ones the operator sees; the plan's text (earlier fixes applied) only decides the refusal.
    `checkout`: the git checkout the package was installed from, when its root is not one."""
    edit = refused.edit
    text = refused.on_disk if refused.on_disk is not None else refused.text
    result = Explanation(refused.fix, refused.index, edit.file, refused.why,
                         anchor=edit.anchor, replacement=edit.replacement)
    result.missing = text is None
    if text is not None:
        result.occurrences = _occurrences(edit.file, text, edit.anchor)
        result.replacements = _occurrences(edit.file, text, edit.replacement)
        if not result.occurrences:
            similar = nearest_regions(edit.file, text, edit.anchor)
            result.nearest, result.runners_up = (similar[0], similar[1:]) if similar else (None, [])
        result.written_by = _written_by(edit.anchor, refused.text,
                                        [u for u in earlier if u.name != refused.fix])
        marker = f"beam-hpu fix {refused.fix}"
        result.markers = [_region(edit.file, text, i, i, 1.0) for i, line in
                          enumerate(text.splitlines(), 1) if marker in line]
        if result.markers and not result.replacements:
            result.older = nearest_region(edit.file, text, edit.replacement)
    if not result.occurrences:
        best = result.nearest.ratio if result.nearest else 0.0
        result.elsewhere = _search_package(refused.root, edit.file, edit.anchor,
                                           fuzzy_above=best if best < CLOSE else None)
    if text is not None and not result.occurrences:
        path = Path(checkout or refused.root) / edit.file
        for region in [r for r in [result.nearest, *result.runners_up] if r is not None]:
            by = newest_change(path, region.first, region.last)
            if by:
                result.changed_by[region.place()] = by
    return result


# The first-parent commits looked at for the newest change of a region: a release branch's recent
# PRs, or every merge of a tree built from a base and a list of PRs.
NEWEST_CHANGE_DEPTH = 64


def newest_change(path: Path, first: int, last: int) -> str:
    """"<short commit> <subject>" of the newest commit on HEAD's first-parent line that brought
    any of lines first..last of `path` (within NEWEST_CHANGE_DEPTH commits); "" when `path` is
    not in a git checkout or the lines are older."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(path.parent), *args], capture_output=True, text=True)

    blame = git("blame", "--porcelain", "-L", f"{first},{last}", "--", path.name)
    if blame.returncode != 0:
        return ""
    commits = {line.split()[0] for line in blame.stdout.splitlines()
               if len(line) > 40 and all(c in "0123456789abcdef" for c in line[:40])}
    line = git("rev-list", "--first-parent", "-n", str(NEWEST_CHANGE_DEPTH + 1), "HEAD").stdout.split()
    for index, commit in enumerate(line[:NEWEST_CHANGE_DEPTH]):
        parent = line[index + 1] if index + 1 < len(line) else None
        if any(parent is None or git("merge-base", "--is-ancestor", c, parent).returncode != 0 for c in commits):
            return git("log", "-1", "--format=%h %s", commit).stdout.strip()
    return ""


def nearest_region(file: str, text: str, needle: str) -> Region | None:
    found = nearest_regions(file, text, needle, count=1)
    return found[0] if found else None


def nearest_regions(file: str, text: str, needle: str, count: int = 3) -> list[Region]:
    """The `count` regions of `text` most similar to `needle` (difflib ratio, indentation
    ignored), best first and not overlapping: windows of the needle's line count, each then
    widened or narrowed by up to two lines around its start."""
    lines = text.splitlines(keepends=True)
    flat = [line.strip() for line in lines]  # indentation is not what tells two regions apart
    size = len(needle.strip("\n").splitlines())
    if not lines or not size:
        return []
    matcher = difflib.SequenceMatcher(None, autojunk=False)
    matcher.set_seq2(_flatten(needle.splitlines()))
    top: list[tuple[float, int, int]] = []  # (ratio, start, line count), best first

    def floor() -> float:
        return top[-1][0] if len(top) == count else 0.0

    def score(start: int, span: int) -> float:
        matcher.set_seq1(_flatten(flat[start:start + span]))
        if matcher.real_quick_ratio() <= floor() or matcher.quick_ratio() <= floor():
            return 0.0
        return matcher.ratio()

    def keep(ratio: float, start: int, span: int) -> None:
        clash = [t for t in top if t[1] < start + span and start < t[1] + t[2]]
        if ratio <= floor() or any(ratio <= t[0] for t in clash):
            return
        top[:] = sorted([t for t in top if t not in clash] + [(ratio, start, span)], reverse=True)[:count]

    for start in range(max(1, len(lines) - size + 1)):
        keep(score(start, size), start, size)
    for _, first, _ in list(top):  # refine each around its start
        best = max(((score(s, n), s, n) for s in range(max(0, first - 2), min(len(lines), first + 3))
                    for n in range(max(1, size - 2), size + 3)), default=(0.0, first, size))
        keep(*best)
    return [_region(file, text, start + 1, min(len(lines), start + span), ratio)
            for ratio, start, span in top if ratio > 0]


def _flatten(lines) -> str:
    return "\n".join(line.strip() for line in lines if line.strip())


def _occurrences(file: str, text: str, needle: str) -> list[Region]:
    found, at = [], text.find(needle)
    while at >= 0:
        body = needle.strip("\n")
        begin = at + needle.index(body) if body else at
        first = text.count("\n", 0, begin) + 1
        found.append(_region(file, text, first, first + body.count("\n"), 1.0))
        at = text.find(needle, at + 1)
    return found


def _occurrences_ignoring_indent(file: str, text: str, needle: str) -> list[Region]:
    want = [line.strip() for line in needle.splitlines() if line.strip()]
    have = [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    found = []
    for at in range(len(have) - len(want) + 1):
        if have[at][1] == want[0] and [line for _, line in have[at:at + len(want)]] == want:
            found.append(_region(file, text, have[at][0], have[at + len(want) - 1][0], 1.0))
    return found


def _written_by(anchor: str, text: str, earlier) -> dict[str, list[str]]:
    present = {line.strip() for line in text.splitlines()}
    missing = [line.strip() for line in anchor.splitlines() if line.strip() and line.strip() not in present]
    out: dict[str, list[str]] = {}
    for unit in earlier:
        written = {line.strip() for e in unit.edits for line in e.replacement.splitlines()}
        lines = [line for line in missing if line in written]
        if lines:
            out[unit.name] = lines
    return out


def _search_package(root: Path, file: str, anchor: str, fuzzy_above: float | None) -> list[Region]:
    """Exact occurrences of the anchor in the package's other .py files; when there are none and
    `fuzzy_above` is given (the target file has nothing close), the one most similar region among
    them if its ratio is higher."""
    package = root / Path(file).parts[0]
    if not package.is_dir():
        return []
    others = [p for p in sorted(package.rglob("*.py")) if p != root / file and "__pycache__" not in p.parts]
    texts = {}
    for path in others:
        try:
            texts[path.relative_to(root).as_posix()] = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
    exact = [r for rel, text in texts.items() for r in _occurrences(rel, text, anchor)]
    if not exact:  # moved and re-indented (a method become a function, a block nested deeper)
        exact = [r for rel, text in texts.items() for r in _occurrences_ignoring_indent(rel, text, anchor)]
    if exact or fuzzy_above is None:
        return exact
    best = None
    for rel, text in texts.items():
        region = nearest_region(rel, text, anchor)
        if region is not None and region.ratio > max(fuzzy_above, best.ratio if best else 0.0):
            best = region
    return [best] if best else []


def _region(file: str, text: str, first: int, last: int, ratio: float) -> Region:
    lines = text.splitlines(keepends=True)
    return Region(file, first, last, ratio, "".join(lines[first - 1:last]), _scope(text, first))


_SCOPES: list = [None, []]  # (text, its definitions): the last text asked about


def _scope(text: str, line: int) -> str:
    if _SCOPES[0] is not text:
        _SCOPES[:] = [text, _definitions(text)]
    inner = [(first, name) for first, last, name in _SCOPES[1] if first <= line <= last]
    return max(inner)[1] if inner else ""


def _definitions(text: str) -> list[tuple[int, int, str]]:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                out.append((child.lineno, child.end_lineno, name))
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


def _diff(needle: str, region: Region, label: str) -> list[str]:
    return list(difflib.unified_diff(needle.strip("\n").splitlines(), region.text.strip("\n").splitlines(),
                                     fromfile=label, tofile=region.place(), lineterm=""))
