"""The startup guard's VLLM_MERGED_PREFILL rule against the vllm-gaudi tree named by GAUDI_FIXES_ROOT:
the variable is the one the tree reads for `merged_prefill`, and the guard refuses exactly the values
the tree's own `boolean` turns on (why merged prefill is refused for Beam:
tests/runtime/window_kv/test_tree_e2e.py::test_merged_prefill_through_the_three_units)."""

from __future__ import annotations

import ast

import pytest

from beam_hpu.settings.guards import MERGED_PREFILL_ENV, VLLM_GAUDI_TRUE, Launch, merged_prefill
from tests.support.gaudi.source import load
from tests.support.gaudi.tree import gaudi_root

pytestmark = pytest.mark.gaudi_tree

EXTENSION = "vllm_gaudi/extension"
SPELLINGS = VLLM_GAUDI_TRUE + tuple(v.upper() for v in VLLM_GAUDI_TRUE) + (
    "0", "false", "no", "off", "", "2", "enabled", " 1", "truee")


def test_the_tree_reads_merged_prefill_from_the_guarded_variable():
    features = ast.parse((gaudi_root() / EXTENSION / "features.py").read_text())
    calls = [n for n in ast.walk(features) if isinstance(n, ast.Call) and ast.unparse(n.func) == "Value"
             and n.args and isinstance(n.args[0], ast.Constant) and n.args[0].value == "merged_prefill"]
    assert len(calls) == 1 and not [k for k in calls[0].keywords if k.arg == "env_var"]  # so VLLM_ + name.upper()
    value_init = load(gaudi_root() / EXTENSION / "config.py", "__init__", "Value", Optional=object, Any=object,
                      boolean=None, Constructor=object, Checker=object, skip_validation=None)
    value = type("Value", (), {})()
    value_init(value, "merged_prefill", False)
    assert value.env_var == MERGED_PREFILL_ENV


def test_the_guard_refuses_exactly_what_the_tree_turns_on():
    boolean = load(gaudi_root() / EXTENSION / "config.py", "boolean")
    for spelling in SPELLINGS:
        launch = Launch({MERGED_PREFILL_ENV: spelling}, {}, {}, "hpu")
        assert bool(merged_prefill(launch)) == boolean(spelling), spelling
    assert {boolean(s) for s in SPELLINGS} == {True, False}
