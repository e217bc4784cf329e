"""The public vllm-gaudi tree the Gaudi-side tests run on, in this order:

1. `GAUDI_FIXES_ROOT`, a vllm-gaudi checkout named by the caller;
2. the checkout of 091bbadd already in the cache outside this clone (`$BEAM_HPU_CACHE`, default
   `~/.cache/beam-hpu`, folder `vllm-gaudi-091bbadd`), whatever made it;
3. `GAUDI_GIT`, a vllm-gaudi git directory (a clone, or a bare mirror with the commit): the
   091bbadd checkout is made from it into the cache once and reused.

Without any of them the tests that need a tree (marked `gaudi_tree`) skip and name what is missing
(tests/conftest.py); the README says how to get one.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

COMMIT = "091bbadd"
TREE_NAME = f"vllm-gaudi-{COMMIT}"
MISSING = (f"no vllm-gaudi tree: set GAUDI_FIXES_ROOT to a checkout of {COMMIT}, or GAUDI_GIT to a "
           f"vllm-gaudi git directory holding {COMMIT} (a checkout is made from it under "
           f"$BEAM_HPU_CACHE, default ~/.cache/beam-hpu/{TREE_NAME})")


def cache_dir() -> Path:
    return Path(os.environ.get("BEAM_HPU_CACHE") or Path.home() / ".cache" / "beam-hpu")


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], capture_output=True, text=True)


def head(tree: Path) -> str | None:
    """The commit checked out at `tree`, or None when it is no whole vllm-gaudi checkout."""
    if not (tree / "vllm_gaudi" / "__init__.py").is_file():
        return None
    proc = _git("-C", str(tree), "rev-parse", "HEAD")
    return proc.stdout.strip() if proc.returncode == 0 else None


def cached_tree(into: Path | None = None) -> Path | None:
    tree = (into or cache_dir()) / TREE_NAME
    return tree if (head(tree) or "").startswith(COMMIT) else None


def checkout_from_git(git_dir: Path, into: Path | None = None) -> Path:
    """The 091bbadd checkout made from `git_dir` under `into` (once; a second call, or another xdist
    worker, reuses it). The checkout is made in a temp folder renamed into place, so a half-made
    tree is never taken for a whole one."""
    into = into or cache_dir()
    tree = into / TREE_NAME
    into.mkdir(parents=True, exist_ok=True)
    with open(into / f".{TREE_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cached_tree(into):
            return tree
        if _git("-C", str(git_dir), "cat-file", "-e", f"{COMMIT}^{{commit}}").returncode != 0:
            raise RuntimeError(f"GAUDI_GIT={git_dir}: no git directory holding commit {COMMIT}")
        shutil.rmtree(tree, ignore_errors=True)
        tmp = into / f".{TREE_NAME}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            for args in (("clone", "-q", "--no-checkout", str(git_dir), str(tmp)),
                         ("-C", str(tmp), "checkout", "-q", "--detach", COMMIT)):
                proc = _git(*args)
                if proc.returncode != 0:
                    raise RuntimeError(f"GAUDI_GIT={git_dir}: git {' '.join(args[:3])} failed: "
                                       f"{proc.stderr.strip()}")
            if not (head(tmp) or "").startswith(COMMIT):
                raise RuntimeError(f"GAUDI_GIT={git_dir}: the checkout of {COMMIT} has no vllm_gaudi/")
            tmp.rename(tree)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return tree


def ensure_gaudi_fixes_root() -> str | None:
    """Set GAUDI_FIXES_ROOT from the cache or GAUDI_GIT when the caller has not set it."""
    if os.environ.get("GAUDI_FIXES_ROOT"):
        return os.environ["GAUDI_FIXES_ROOT"]
    tree = cached_tree()
    if tree is None and os.environ.get("GAUDI_GIT"):
        tree = checkout_from_git(Path(os.environ["GAUDI_GIT"]))
    if tree is None:
        return None
    os.environ["GAUDI_FIXES_ROOT"] = str(tree)
    return os.environ["GAUDI_FIXES_ROOT"]
