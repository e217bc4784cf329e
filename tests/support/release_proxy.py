"""A vllm-gaudi tree closer to releases/v0.30.0 than public main: the *release proxy*.

091bbadd with every PR of the release's changelog that a vllm-gaudi git directory holds as
`refs/pull/N/head` merged onto it, in changelog order (tests/support/gaudi/release_v0_30_0.toml
lists them, their heads, which 091bbadd already has and which the public mirror lacks). A merge
that conflicts outside what the data file resolves refuses the build, naming the PR. The merges
are made with a fixed identity and date, so the same inputs give the same commit.

Built once into the cache outside the checkout (`$BEAM_HPU_CACHE/vllm-gaudi-release-proxy`, its
manifest beside it); tests/conftest.py names it in GAUDI_PROXY_ROOT. The fix profiles for it are
written per session (`write_proxy_profiles`): the stand-in profiles with the proxy's commit, and
the port without the units the data file says the proxy's PRs break.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

from tests.support.gaudi_tree import cache_dir

CHANGELOG = Path(__file__).parent / "gaudi" / "release_v0_30_0.toml"
PROXY_NAME = "vllm-gaudi-release-proxy"
FIXES_PROFILE = "v0.30.0-release-proxy"
PORT_PROFILE = "port-beam-1-0-release-proxy"
WHOLE_PORT_PROFILE = "port-beam-1-0-release-proxy-whole"
MISSING = (f"no release proxy: set GAUDI_GIT to a vllm-gaudi git directory (a clone, or the fetched "
           f"mirror with refs/pull/N/head) to build one under $BEAM_HPU_CACHE/{PROXY_NAME}")
_IDENTITY = {"GIT_AUTHOR_NAME": "beam-hpu release proxy", "GIT_AUTHOR_EMAIL": "proxy@beam-hpu.invalid",
             "GIT_COMMITTER_NAME": "beam-hpu release proxy", "GIT_COMMITTER_EMAIL": "proxy@beam-hpu.invalid",
             "GIT_AUTHOR_DATE": "2026-09-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2026-09-01T00:00:00+0000"}


class ProxyError(RuntimeError):
    pass


@dataclass(frozen=True)
class ChangelogPR:
    number: int
    title: str
    status: str  # in_base | ref | missing (in the public mirror)
    head: str = ""
    keep: str = ""  # the side `git merge -X` keeps where the merge conflicts in `resolve_files`
    resolve_files: tuple[str, ...] = ()
    divergence: str = ""  # "<unit> edit N: ..." when a port unit misses its anchor because of it

    def name(self) -> str:
        return f"#{self.number} {self.title!r}"

    def diverging_unit(self) -> str:
        return self.divergence.split(" ", 1)[0] if self.divergence else ""


@dataclass(frozen=True)
class Changelog:
    base: str
    release: str
    prs: tuple[ChangelogPR, ...]
    digest: str  # of the data file: a changed file rebuilds the proxy


def read_changelog(path: Path = CHANGELOG) -> Changelog:
    raw = path.read_bytes()
    data = tomllib.loads(raw.decode())
    prs = []
    for entry in data["prs"]:
        resolve = entry.get("resolve", {})
        prs.append(ChangelogPR(entry["number"], entry["title"], entry["status"], entry.get("head", ""),
                               resolve.get("keep", ""), tuple(resolve.get("files", ())),
                               entry.get("divergence", "")))
    return Changelog(data["base"], data["release"], tuple(prs), hashlib.sha256(raw).hexdigest()[:16])


def _git(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                          env=None if env is None else {**os.environ, **env})


def manifest_path(into: Path) -> Path:
    return into / f"{PROXY_NAME}.json"


def cached_proxy(into: Path | None = None, changelog: Changelog | None = None) -> Path | None:
    """The proxy under `into` when it was built from this data file and is whole."""
    into = into or cache_dir()
    changelog = changelog or read_changelog()
    tree, manifest = into / PROXY_NAME, manifest_path(into)
    if not manifest.is_file() or not (tree / "vllm_gaudi" / "__init__.py").is_file():
        return None
    recorded = json.loads(manifest.read_text())
    head = _git("-C", str(tree), "rev-parse", "HEAD").stdout.strip()
    return tree if recorded.get("changelog") == changelog.digest and recorded.get("head") == head else None


def read_manifest(into: Path | None = None) -> dict:
    return json.loads(manifest_path(into or cache_dir()).read_text())


def build_release_proxy(git_dir: Path, into: Path | None = None, changelog_path: Path = CHANGELOG) -> Path:
    """The proxy built from `git_dir` under `into` (once: a second call, or another xdist worker,
    reuses it). Made in a temp folder renamed into place, so a refused build leaves nothing."""
    into = into or cache_dir()
    changelog = read_changelog(changelog_path)
    into.mkdir(parents=True, exist_ok=True)
    with open(into / f".{PROXY_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cached_proxy(into, changelog):
            return into / PROXY_NAME
        tmp = into / f".{PROXY_NAME}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            record = _merge_changelog(Path(git_dir), tmp, changelog)
            shutil.rmtree(into / PROXY_NAME, ignore_errors=True)
            tmp.rename(into / PROXY_NAME)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        manifest_path(into).write_text(json.dumps(record, indent=1) + "\n")
        return into / PROXY_NAME


def _merge_changelog(git_dir: Path, tree: Path, changelog: Changelog) -> dict:
    where = f"GAUDI_GIT={git_dir}"
    if _git("-C", str(git_dir), "cat-file", "-e", f"{changelog.base}^{{commit}}").returncode != 0:
        raise ProxyError(f"{where}: no git directory holding commit {changelog.base}")
    for args in (("clone", "-q", "--no-checkout", str(git_dir), str(tree)),
                 ("-C", str(tree), "checkout", "-q", "--detach", changelog.base)):
        proc = _git(*args)
        if proc.returncode != 0:
            raise ProxyError(f"{where}: git {' '.join(args[:3])} failed: {proc.stderr.strip()}")
    base_subjects = _git("-C", str(tree), "log", "--format=%s", changelog.base).stdout
    record = {"changelog": changelog.digest, "base": changelog.base, "release": changelog.release,
              "in_base": [], "merged": [], "missing": [], "resolved": {}, "divergences": {}}
    for pr in changelog.prs:
        if f"(#{pr.number})" in base_subjects:
            record["in_base"].append(pr.number)
            continue
        head = _pr_head(tree, git_dir, pr)
        if head is None:
            record["missing"].append(pr.number)
            continue
        resolved = _merge(tree, pr, head)
        record["merged"].append(pr.number)
        if resolved:
            record["resolved"][str(pr.number)] = resolved
        if pr.divergence:
            record["divergences"][str(pr.number)] = pr.divergence
    record["head"] = _git("-C", str(tree), "rev-parse", "HEAD").stdout.strip()
    return record


def _pr_head(tree: Path, git_dir: Path, pr: ChangelogPR) -> str | None:
    """The commit to merge for `pr`: its pinned head, else refs/pull/N/head; None when the git
    directory has neither. A ref that moved away from the pinned head is refused."""
    fetched = _git("-C", str(tree), "fetch", "-q", str(git_dir), f"refs/pull/{pr.number}/head")
    ref_head = _git("-C", str(tree), "rev-parse", "FETCH_HEAD").stdout.strip() if fetched.returncode == 0 else ""
    if pr.head:
        if _git("-C", str(tree), "cat-file", "-e", f"{pr.head}^{{commit}}").returncode == 0:
            return pr.head
        if ref_head:
            raise ProxyError(f"{pr.name()}: refs/pull/{pr.number}/head is {ref_head[:12]}, not the pinned "
                             f"head {pr.head[:12]} (tests/support/gaudi/release_v0_30_0.toml)")
        return None
    return ref_head or None


def _merge(tree: Path, pr: ChangelogPR, head: str) -> list[str]:
    """Merge `head`; the files whose conflicts the data file resolved (empty: none conflicted)."""
    message = f"release proxy: merge vllm-gaudi #{pr.number} ({pr.title})"
    args = ["-C", str(tree), "merge", "-q", "--no-ff", "--no-edit", "-m", message]
    if _git(*args, head, env=_IDENTITY).returncode == 0:
        return []
    conflicted = _git("-C", str(tree), "diff", "--name-only", "--diff-filter=U").stdout.split()
    _git("-C", str(tree), "merge", "--abort")
    unresolved = sorted(set(conflicted) - set(pr.resolve_files))
    if not conflicted or unresolved or not pr.keep:
        raise ProxyError(f"{pr.name()}: merging {head[:12]} onto the release proxy conflicts in "
                         f"{', '.join(unresolved or conflicted) or '(no file: git merge failed)'}; "
                         "tests/support/gaudi/release_v0_30_0.toml resolves none of these")
    proc = _git(*args, "-X", pr.keep, head, env=_IDENTITY)
    if proc.returncode != 0:
        raise ProxyError(f"{pr.name()}: merge with -X {pr.keep} failed: {proc.stderr.strip()}")
    return sorted(conflicted)


def write_proxy_profiles(head: str, dst: Path, changelog: Changelog | None = None) -> Path:
    """A profiles directory for the proxy at commit `head`: the repository's profiles, plus
    v0.30.0-release-proxy (the v0.30.0 fixes, expecting `head`) and port-beam-1-0-release-proxy
    (the port's units on it, less those the data file names as broken by a merged PR)."""
    from fixes.profile import PROFILES_DIR, load_profile

    changelog = changelog or read_changelog()
    dst.mkdir(parents=True, exist_ok=True)
    for path in PROFILES_DIR.glob("*.toml"):
        shutil.copy(path, dst / path.name)
    broken = {pr.diverging_unit() for pr in changelog.prs if pr.divergence}
    port = [u.name for u in load_profile("port-beam-1-0").fixes
            if u.name not in {f.name for f in load_profile("v0.30.0").fixes}]
    (dst / f"{FIXES_PROFILE}.toml").write_text(
        'extends = "v0.30.0"\n'
        f'description = "release proxy: vLLM 0.30.0 + vllm-gaudi {changelog.base} with the release\'s PRs"\n'
        f'[packages.vllm_gaudi]\ncommit = "{head}"\n')
    for name, units, what in ((PORT_PROFILE, [u for u in port if u not in broken], "less the units its PRs break"),
                              (WHOLE_PORT_PROFILE, port, "every unit (what --explain is run with)")):
        (dst / f"{name}.toml").write_text(
            'extends = "port-beam-1-0"\n'
            f'base = "{FIXES_PROFILE}"\n'
            f'description = "the beam-1-0 port on the release proxy, {what}"\n'
            f"fixes = {json.dumps(units)}\n"
            f'[packages.vllm_gaudi]\ncommit = "{head}"\n')
    return dst


def edited_scopes(root: Path, unit) -> dict[tuple[str, str], str]:
    """(file, innermost def or class) -> its text, for each line of a patched tree at `root` that
    carries `unit`'s marker; a marker outside any def stands for the three lines either side. Two
    trees whose units edit identical scopes run the unit's code the same way."""
    from fixes.explain import _definitions

    found = {}
    for file in unit.files:
        text = (root / file).read_text()
        lines, definitions = text.splitlines(), _definitions(text)
        for number, line in enumerate(lines, 1):
            if f"beam-hpu fix {unit.name}" not in line:
                continue
            inner = [d for d in definitions if d[0] <= number <= d[1]]
            first, last, name = max(inner) if inner else (max(1, number - 3), number + 3, line.strip())
            found[(file, name)] = "\n".join(lines[first - 1:last])
    return found


# Why this session has no proxy although GAUDI_GIT names a git directory (the proxy tests fail with it)
BUILD_PROBLEM: list[str] = []


def ensure_release_proxy_root() -> None:
    """Set GAUDI_PROXY_ROOT from the cache, or from a proxy built from GAUDI_GIT, unless the caller
    set it. A build the data file refuses leaves it unset and says why in BUILD_PROBLEM."""
    if os.environ.get("GAUDI_PROXY_ROOT"):
        return
    tree = cached_proxy()
    if tree is None and os.environ.get("GAUDI_GIT"):
        try:
            tree = build_release_proxy(Path(os.environ["GAUDI_GIT"]))
        except ProxyError as exc:
            BUILD_PROBLEM.append(str(exc))
    if tree is not None:
        os.environ["GAUDI_PROXY_ROOT"] = str(tree)
