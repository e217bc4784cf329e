"""The beam-1-0 port profile as a whole (profile port-beam-1-0; its units in
beam_hpu/runtime/<feature>/beam-*.toml) on the vllm-gaudi tree named by GAUDI_FIXES_ROOT: it
applies after every v0.30.0 fix, once, parses and checks; it refuses a tree without the v0.30.0
fixes; and the v0.30.0 profile still finds its own fixes on the port's tree. What each unit does
is tested in its feature's room (tests/runtime/<feature>/test_tree_*.py)."""
from __future__ import annotations

import ast

import pytest

from fixes.engine import EXIT_OK, run
from tests.support.gaudi.fix_trees import tree_digest
from tests.support.gaudi.source import RUNNER
from tests.support.gaudi.tree import PORT_PROFILE, PORT_UNITS, apply_port, copy_tree, gaudi_units, tree_profile

pytestmark = pytest.mark.gaudi_tree


# ---------------------------------------------------------------- the profile

def test_port_profile_applies_once_parses_and_checks(tmp_path):
    root, checkouts = copy_tree(tmp_path / "site")
    first = apply_port(root, checkouts)
    assert first.exit_code == EXIT_OK, first.lines
    assert set(first.states.values()) == {"applied"}, first.lines
    assert list(first.states)[-len(PORT_UNITS):] == PORT_UNITS  # after every v0.30.0 fix
    ast.parse((root / RUNNER).read_text())
    before = tree_digest(root)
    second = apply_port(root, checkouts)
    assert set(second.states.values()) == {"already applied"}, second.lines
    assert tree_digest(root) == before
    assert apply_port(root, checkouts, check=True).exit_code == EXIT_OK
    # Both stamps are fresh: the v0.30.0 profile's own --check passes on the port's tree.
    base = tree_profile(PORT_PROFILE).base
    assert run(base, roots={"vllm_gaudi": str(root)}, checkouts=checkouts,
               only=[n for n in gaudi_units(base)], check=True).exit_code == EXIT_OK


def test_port_patches_refuse_a_tree_without_the_v030_fixes(tmp_path):
    # Only the port's units on a stock tree: the decode edit anchors on swa-decode-window's text.
    root, checkouts = copy_tree(tmp_path / "site")
    before = tree_digest(root)
    report = apply_port(root, checkouts, only=PORT_UNITS)
    assert report.exit_code != EXIT_OK
    assert report.states["beam-exact-window"] == "refused", report.lines
    assert tree_digest(root) == before


def test_v030_profile_still_finds_its_fixes_after_the_port(tmp_path):
    """The recipe's launch runs `apply_all.py --profile v0.30.0` on the port image: the port's
    edits must leave every v0.30.0 replacement intact (found "already applied")."""
    root, checkouts = copy_tree(tmp_path / "site")
    assert apply_port(root, checkouts).exit_code == EXIT_OK
    base = tree_profile(PORT_PROFILE).base
    again = run(base, roots={"vllm_gaudi": str(root)}, checkouts=checkouts, only=gaudi_units(base))
    assert again.exit_code == EXIT_OK and set(again.states.values()) == {"already applied"}, again.lines
