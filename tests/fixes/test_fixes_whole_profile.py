"""The whole v0.30.0 profile (the public-main stand-in) on temp copies of vLLM and vllm-gaudi:
all twelve fixes applied, then all twelve found already applied, through the CLI."""
from __future__ import annotations

import pytest

from fixes.engine import EXIT_OK
from tests.support.gaudi.fix_trees import apply_all, tree_digest
from tests.support.gaudi.tree import PROFILE, TREE_PROFILES_DIR, copy_tree, tree_profile

pytestmark = pytest.mark.gaudi_tree


def test_whole_profile_applies_all_twelve_then_finds_them_applied(vllm_tree, tmp_path):
    gaudi_root, checkouts = copy_tree(tmp_path / "gaudi")
    names = [u.name for u in tree_profile(PROFILE).fixes]
    assert len(names) == 12 and all(u.edits for u in tree_profile(PROFILE).fixes)
    args = ["--profiles-dir", str(TREE_PROFILES_DIR), "--profile", PROFILE, "--root", f"vllm={vllm_tree}",
            "--root", f"vllm_gaudi={gaudi_root}"]
    args += [f"--checkout={m}={d}" for m, d in checkouts.items()]

    def fix_lines(out: str) -> list[str]:
        return [line for line in out.splitlines() if line.split(":")[0] in names]

    first = apply_all(*args)
    assert first.returncode == EXIT_OK, first.stdout + first.stderr
    assert fix_lines(first.stdout) == [f"{n}: applied" for n in names]
    after_first = tree_digest(vllm_tree) | tree_digest(gaudi_root)

    second = apply_all(*args)
    assert second.returncode == EXIT_OK, second.stdout + second.stderr
    assert fix_lines(second.stdout) == [f"{n}: already applied" for n in names]
    assert tree_digest(vllm_tree) | tree_digest(gaudi_root) == after_first  # nothing rewritten
    check = apply_all(*args, "--check")
    assert check.returncode == EXIT_OK, check.stdout
