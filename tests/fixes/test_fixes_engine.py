"""The engine against real vLLM 0.30.0 files: apply, idempotence, --check, all-or-nothing."""
from __future__ import annotations

import ast
import json
import os

import pytest

import fixes.transaction as transaction
from fixes.engine import (EXIT_IMAGE, EXIT_NOT_APPLIED, EXIT_OK, EXIT_REFUSED, STAMP_NAME, run)
from tests.support.gaudi.fix_trees import VLLM_FIXES, apply_all, tree_digest
from fixes.profile import load_profile

DETOK = "vllm/tokenizers/detokenizer_utils.py"
EXECUTOR = "vllm/v1/executor/multiproc_executor.py"


def run_vllm_fixes(root, check=False):
    return run(load_profile("v0.30.0"), roots={"vllm": str(root)}, only=VLLM_FIXES, check=check)


def test_apply_then_everything_already_applied(vllm_tree):
    first = run_vllm_fixes(vllm_tree)
    assert first.exit_code == EXIT_OK, first.lines
    assert first.states == {n: "applied" for n in VLLM_FIXES}
    for rel in (DETOK, EXECUTOR):
        text = (vllm_tree / rel).read_text()
        ast.parse(text)
        assert "beam-hpu fix" in text
    stamp = json.loads((vllm_tree / "vllm" / STAMP_NAME).read_text())
    assert stamp["profile"] == "v0.30.0" and stamp["fixes"] == VLLM_FIXES
    assert set(stamp["files"]) == {DETOK, EXECUTOR}

    before = tree_digest(vllm_tree)
    second = run_vllm_fixes(vllm_tree)
    assert second.exit_code == EXIT_OK, second.lines
    assert second.states == {n: "already applied" for n in VLLM_FIXES}
    assert any(line.endswith("unchanged") for line in second.lines if line.startswith("stamp:"))
    assert tree_digest(vllm_tree) == before


def test_check_never_writes_and_tells_applied_from_not(vllm_tree):
    before = tree_digest(vllm_tree)
    report = run_vllm_fixes(vllm_tree, check=True)
    assert report.exit_code == EXIT_NOT_APPLIED
    assert report.states == {n: "not applied" for n in VLLM_FIXES}
    assert tree_digest(vllm_tree) == before
    assert run_vllm_fixes(vllm_tree).exit_code == EXIT_OK
    assert run_vllm_fixes(vllm_tree, check=True).exit_code == EXIT_OK


def test_check_flags_a_missing_stamp(vllm_tree):
    run_vllm_fixes(vllm_tree)
    (vllm_tree / "vllm" / STAMP_NAME).unlink()
    report = run_vllm_fixes(vllm_tree, check=True)
    assert report.exit_code == EXIT_NOT_APPLIED
    assert any("missing" in line for line in report.lines if line.startswith("stamp:"))


@pytest.mark.parametrize("damage", ["drop", "duplicate"])
def test_anchor_drift_refuses_and_writes_nothing(vllm_tree, damage):
    unit = next(u for u in load_profile("v0.30.0").fixes if u.name == "rank-exception-fatal")
    anchor = unit.edits[0].anchor
    path = vllm_tree / EXECUTOR
    text = path.read_text()
    path.write_text(text.replace(anchor, "\n") if damage == "drop" else text + "\nif 0:" + anchor)
    before = tree_digest(vllm_tree)
    report = run_vllm_fixes(vllm_tree)
    assert report.exit_code == EXIT_REFUSED
    assert report.states["rank-exception-fatal"] == "refused"
    assert report.states["logprobs-decode-guard"] == "not applied"  # nothing written at all
    why = "anchor not found" if damage == "drop" else "anchor found 2 times"
    assert why in "\n".join(report.lines)
    assert tree_digest(vllm_tree) == before


def test_a_result_that_would_not_parse_is_refused(vllm_tree):
    path = vllm_tree / DETOK
    path.write_text(path.read_text() + "\nbroken = (\n")
    before = tree_digest(vllm_tree)
    report = run_vllm_fixes(vllm_tree)
    assert report.exit_code == EXIT_REFUSED
    assert "would not parse" in "\n".join(report.lines)
    assert tree_digest(vllm_tree) == before


def test_failure_after_the_first_write_leaves_the_tree_as_it_was(vllm_tree, monkeypatch):
    calls = []

    def failing_replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device (injected)")
        os.replace(src, dst)

    monkeypatch.setattr(transaction, "_replace", failing_replace)
    before = tree_digest(vllm_tree)
    report = run_vllm_fixes(vllm_tree)
    assert len(calls) == 2  # one file had been swapped in before the failure
    assert report.exit_code == EXIT_REFUSED
    assert "every file put back as it was" in "\n".join(report.lines)
    assert set(report.states.values()) == {"refused"}
    assert tree_digest(vllm_tree) == before  # also: no staged temp files left behind


def test_a_bad_read_back_rolls_everything_back(vllm_tree, monkeypatch):
    real = transaction._read_back
    seen = []

    def corrupting_read_back(path):
        seen.append(path)
        return real(path) + ("#" if len(seen) == 3 else "")

    monkeypatch.setattr(transaction, "_read_back", corrupting_read_back)
    before = tree_digest(vllm_tree)
    report = run_vllm_fixes(vllm_tree)
    assert report.exit_code == EXIT_REFUSED
    assert "reads back different" in "\n".join(report.lines)
    assert tree_digest(vllm_tree) == before


def test_a_read_only_target_is_refused_with_a_clear_error(vllm_tree):
    path = vllm_tree / EXECUTOR
    path.chmod(0o444)
    before = tree_digest(vllm_tree)
    report = run_vllm_fixes(vllm_tree)
    assert report.exit_code == EXIT_REFUSED
    assert report.states["rank-exception-fatal"] == "refused"
    assert f"{path} is read-only" in "\n".join(report.lines)
    assert tree_digest(vllm_tree) == before


def test_cli_twice_reports_applied_then_already_applied(vllm_tree):
    args = ["--profile", "v0.30.0", "--root", f"vllm={vllm_tree}"]
    for fix in VLLM_FIXES:
        args += ["--fix", fix]
    first = apply_all(*args)
    assert first.returncode == EXIT_OK, first.stdout + first.stderr
    assert [f"{n}: applied" for n in VLLM_FIXES] == [
        line for line in first.stdout.splitlines() if line.split(":")[0] in VLLM_FIXES]
    second = apply_all(*args)
    assert second.returncode == EXIT_OK
    assert [f"{n}: already applied" for n in VLLM_FIXES] == [
        line for line in second.stdout.splitlines() if line.split(":")[0] in VLLM_FIXES]
    assert apply_all(*args, "--check").returncode == EXIT_OK


def test_cli_whole_profile_without_vllm_gaudi_stops_on_the_image(vllm_tree):
    before = tree_digest(vllm_tree)
    result = apply_all("--profile", "v0.30.0", "--root", f"vllm={vllm_tree}",
                       "--root", f"vllm_gaudi={vllm_tree / 'nowhere'}")
    assert result.returncode == EXIT_IMAGE
    assert "image: refused: vllm_gaudi: no package vllm_gaudi/" in result.stdout
    assert tree_digest(vllm_tree) == before


def test_cli_usage_errors(vllm_tree):
    assert apply_all("--profile", "v9.9.9").returncode == 2
    assert apply_all("--profile", "v0.30.0", "--fix", "no-such-fix").returncode == 2
