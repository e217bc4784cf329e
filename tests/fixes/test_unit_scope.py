"""Every fix unit (fixes/units/, the port's in beam_hpu/runtime/<room>/) says which models its edits act for:
`scope = "beam: <how the edited code checks it serves Beam>"` or
`"global: <why it must act for every model, and the test that shows it harmless>"`, and the
loader refuses a unit without one, naming the file."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from fixes.unit import UnitError, load_unit, scope_problem

REPO = Path(__file__).resolve().parents[2]
UNIT_FILES = sorted([*REPO.glob("fixes/units/*.toml"), *REPO.glob("beam_hpu/runtime/*/beam-*.toml")])


def test_there_are_units_to_check():
    assert len(UNIT_FILES) >= 17


@pytest.mark.parametrize("path", UNIT_FILES, ids=lambda p: p.stem)
def test_every_unit_has_a_well_formed_scope(path):
    unit = load_unit(path)
    assert scope_problem(unit.scope) is None
    if unit.scope.startswith("global:"):
        named = re.findall(r"tests/[\w/]+\.py", unit.scope)
        assert named and all((REPO / f).is_file() for f in named), (path.name, named)


def test_port_units_act_for_beam_only():
    """The port's own edits exist for Beam: none may be global (a v0.30.0 bug fix belongs in fixes/units)."""
    for path in REPO.glob("beam_hpu/runtime/*/beam-*.toml"):
        assert load_unit(path).scope.startswith("beam:"), path.name


UNIT = '''name = "{name}"
package = "vllm"
why = "a reason"
{scope}changes = "what it does"
applied_when = "marked"
remove_when = "never"
upstream = "none"

[[edits]]
file = "vllm/x.py"
anchor = "a = 1"
replacement = "a = 2  # beam-hpu fix {name}"
'''


@pytest.mark.parametrize("scope, accepted", [
    ("", False),
    ('scope = "beam: checks hf_config.model_type is beam"\n', True),
    ('scope = "global: every model hits the bug; tests/x.py shows it harmless"\n', True),
    ('scope = "global: every model hits the same bug anyway"\n', False),  # names no test
    ('scope = "beam"\n', False),
    ('scope = "any: checks hf_config.model_type is beam"\n', False),
    ('scope = "beam: yes"\n', False),  # says nothing
])
def test_the_loader_refuses_a_missing_or_malformed_scope(tmp_path, scope, accepted):
    path = tmp_path / "some-fix.toml"
    path.write_text(UNIT.format(name="some-fix", scope=scope))
    if accepted:
        assert load_unit(path).scope == scope.split('"')[1]
    else:
        with pytest.raises(UnitError, match="some-fix.toml.*scope"):
            load_unit(path)
