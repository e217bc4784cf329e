"""The public vllm-gaudi tree the Gaudi-side tests run on: `GAUDI_FIXES_ROOT` if set, else the
shallow checkout `../shared/vllm-gaudi-091bbadd.tar.gz` beside this clone, extracted once outside
the checkout (`$BEAM_HPU_CACHE`, default `~/.cache/beam-hpu`) and reused. Without either, the tests
that need a tree skip and say why (tests/fixes/test_fixes_gaudi.py)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARBALL = REPO.parent / "shared" / "vllm-gaudi-091bbadd.tar.gz"
COMMIT_PREFIX = "091bbadd"


def cache_dir() -> Path:
    return Path(os.environ.get("BEAM_HPU_CACHE") or Path.home() / ".cache" / "beam-hpu")


def _head(tree: Path) -> str | None:
    proc = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def extract(tarball: Path = TARBALL, into: Path | None = None) -> Path:
    """The tree extracted from `tarball` under `into` (once; a second call, or another xdist
    worker, reuses it). Extraction goes to a temp folder renamed into place, so a half-extracted
    tree is never taken for a whole one."""
    into = into or cache_dir()
    tree = into / tarball.name.removesuffix(".tar.gz")
    into.mkdir(parents=True, exist_ok=True)
    with open(into / f".{tree.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        head = _head(tree) if (tree / "vllm_gaudi" / "__init__.py").is_file() else None
        if head and head.startswith(COMMIT_PREFIX):
            return tree
        shutil.rmtree(tree, ignore_errors=True)
        tmp = into / f".{tree.name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            with tarfile.open(tarball) as tar:
                tar.extractall(tmp, filter="data")
            tops = [p for p in tmp.iterdir()]
            if len(tops) != 1 or not (tops[0] / "vllm_gaudi" / "__init__.py").is_file():
                raise RuntimeError(f"{tarball}: expected one top folder holding vllm_gaudi/, found "
                                   f"{sorted(p.name for p in tops)}")
            head = _head(tops[0])
            if not (head or "").startswith(COMMIT_PREFIX):
                raise RuntimeError(f"{tarball}: its checkout's HEAD is {head!r}, not {COMMIT_PREFIX}")
            tops[0].rename(tree)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return tree


def ensure_gaudi_fixes_root() -> str | None:
    """Set GAUDI_FIXES_ROOT from the shared tarball when the caller has not set it."""
    if os.environ.get("GAUDI_FIXES_ROOT"):
        return os.environ["GAUDI_FIXES_ROOT"]
    if not TARBALL.is_file():
        return None
    os.environ["GAUDI_FIXES_ROOT"] = str(extract())
    return os.environ["GAUDI_FIXES_ROOT"]
