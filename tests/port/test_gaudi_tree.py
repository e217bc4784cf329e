"""The vllm-gaudi tree the Gaudi-side tests run on comes from ../shared without anyone setting
GAUDI_FIXES_ROOT (tests/support/gaudi_tree.py): extracted once, reused, and a wrong archive refused."""

import os
import subprocess
import tarfile

import pytest

from tests.support.gaudi_tree import COMMIT_PREFIX, TARBALL, extract

needs_tarball = pytest.mark.skipif(not TARBALL.is_file(), reason=f"{TARBALL} is absent (not beside this clone)")


@needs_tarball
def test_this_session_runs_the_tree_tests_from_the_shared_tarball():
    root = os.environ.get("GAUDI_FIXES_ROOT")
    assert root, "tests/conftest.py did not set GAUDI_FIXES_ROOT although the shared tarball is there"
    head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert head.startswith(COMMIT_PREFIX), (root, head)


@needs_tarball
def test_extract_once_then_reuse(tmp_path):
    tree = extract(TARBALL, tmp_path)
    assert (tree / "vllm_gaudi" / "__init__.py").is_file()
    marker = tree / "vllm_gaudi" / "__init__.py"
    before = marker.stat().st_mtime_ns
    assert extract(TARBALL, tmp_path) == tree and marker.stat().st_mtime_ns == before
    assert not list(tmp_path.glob(".*.partial"))


def test_an_archive_without_vllm_gaudi_is_refused_and_nothing_is_left(tmp_path):
    src = tmp_path / "src" / "not-gaudi"
    src.mkdir(parents=True)
    (src / "README.md").write_text("no package here\n")
    archive = tmp_path / "vllm-gaudi-091bbadd.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname="not-gaudi")
    into = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="vllm_gaudi"):
        extract(archive, into)
    assert not (into / "vllm-gaudi-091bbadd").exists() and not list(into.glob(".*.partial"))
