"""Where the Gaudi-side tests get their vllm-gaudi tree (tests/support/gaudi_tree.py): a checkout
already in the cache is used as it is; one is made from a git directory once, reused, and a git
directory without the commit is refused with nothing left behind."""

import os
import subprocess

import pytest

from tests.support.gaudi_tree import COMMIT, TREE_NAME, cached_tree, checkout_from_git


def test_this_session_names_its_tree_or_says_why_not():
    root = os.environ.get("GAUDI_FIXES_ROOT")
    if cached_tree() is not None or os.environ.get("GAUDI_GIT"):
        assert root, "tests/conftest.py did not set GAUDI_FIXES_ROOT although a tree can be had"
    if root:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        assert head.startswith(COMMIT), (root, head)


def _git(*args, cwd):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_a_git_directory_without_the_commit_is_refused_and_nothing_is_left(tmp_path):
    repo = tmp_path / "not-gaudi"
    repo.mkdir()
    _git("init", "-q", cwd=repo)
    (repo / "README.md").write_text("no package here\n")
    _git("add", ".", cwd=repo)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x", cwd=repo)
    into = tmp_path / "cache"
    with pytest.raises(RuntimeError, match=COMMIT):
        checkout_from_git(repo, into)
    assert not (into / TREE_NAME).exists() and not list(into.glob(".*.partial"))


@pytest.mark.skipif(not os.environ.get("GAUDI_FIXES_ROOT"), reason="no vllm-gaudi tree to clone from")
def test_checkout_from_git_once_then_reuse(tmp_path):
    src = os.environ["GAUDI_FIXES_ROOT"]
    tree = checkout_from_git(src, tmp_path)
    assert cached_tree(tmp_path) == tree and (tree / "vllm_gaudi" / "__init__.py").is_file()
    marker = tree / "vllm_gaudi" / "__init__.py"
    before = marker.stat().st_mtime_ns
    assert checkout_from_git(src, tmp_path) == tree and marker.stat().st_mtime_ns == before
    assert not list(tmp_path.glob(".*.partial"))
