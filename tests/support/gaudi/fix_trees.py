"""Helpers for the fix-profile tests: temp copies of the real installed vLLM 0.30.0 sources.

Nothing here patches the shared venv: each test works on its own copy of the files it patches.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.engines import REPO

APPLY_ALL = REPO / "fixes" / "apply_all.py"
VLLM_FIXES = ["logprobs-decode-guard", "rank-exception-fatal"]


def installed_root(module: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None:
        pytest.skip(f"{module} is not installed in this interpreter")
    return Path(spec.origin).resolve().parent.parent


def copy_package_files(src_root: Path, dst_root: Path, module: str, files: list[str],
                       dists: list[str]) -> Path:
    """Copy a package's __init__/_version, the given files and dist-info metadata to dst_root."""
    wanted = {f"{module}/__init__.py", f"{module}/_version.py", *files}
    for rel in wanted:
        if (src_root / rel).is_file():
            (dst_root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src_root / rel, dst_root / rel)
    for dist in dists:
        for info in src_root.glob(f"{dist}-*.dist-info"):
            shutil.copytree(info, dst_root / info.name, dirs_exist_ok=True)
    return dst_root


def vllm_target_files() -> list[str]:
    from fixes.profile import load_profile

    return sorted({f for u in load_profile("v0.30.0").fixes if u.package == "vllm" for f in u.files})


def symlink_tree(src_pkg: Path, dst_pkg: Path, real_files: list[str]) -> None:
    """A whole package as symlinks to the installed files, except `real_files` (copied), so a
    patched copy imports and runs for real without duplicating 500 MB."""
    shutil.copytree(src_pkg, dst_pkg, symlinks=True, copy_function=os.symlink,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for rel in real_files:
        target = dst_pkg.parent / rel
        target.unlink()
        shutil.copy2(src_pkg.parent / rel, target)


def tree_digest(root: Path) -> dict[str, str]:
    """Path -> sha256 of every file under root (symlinks by target), plus each file's mode."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            out[str(path.relative_to(root))] = (
                hashlib.sha256(path.read_bytes()).hexdigest() + f" {path.stat().st_mode:o}")
    return out


def apply_all(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(APPLY_ALL), *args], capture_output=True,
                          text=True, env=env, timeout=300)
