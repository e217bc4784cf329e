"""Every switch of the table has a reader outside the switch table and its validation, and every
switch the recipe sets has one on HPU, the platform the recipe is for.

A reader is code that acts on the switch's value: a call of `switches.current(NAME, ...)` (or
`read_switch(NAME, ...)`) in the package outside `beam_hpu/settings/`, or a port edit whose
replacement text reads it. The launch guards validate every switch and so do not count, except
for a switch whose whole meaning is a launch policy (GUARD_ONLY), read by its rule. The list of
switches nothing reads yet (UNREAD) is part of the test: it fails when a switch loses its reader,
and when one gains a reader without the list saying so. Which readers run on HPU is worked out
in tests/settings/hpu_readers.py.
"""

from __future__ import annotations

import ast
import tomllib

from beam_hpu.settings.switches import SWITCHES, is_port_switch_name
from serving.recipe import load_recipe, parse_launch_block
from tests.settings.hpu_readers import (
    PACKAGE,
    hpu_readers,
    names_read_by_calls,
    names_read_in_text,
    port_units,
)
from tests.support.engines import REPO

# Launch policies: the guard rule is what they govern (beam_hpu/settings/guards.py).
GUARD_ONLY = {"BEAM_ALLOW_EAGER"}
# Switches nothing reads yet.
UNREAD: set[str] = set()
LAUNCH_SCRIPT = REPO / "serving" / "launch.sh"


def code_readers() -> dict[str, list[str]]:
    """Switch -> every file that reads it, on any platform."""
    readers: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "settings" in path.relative_to(PACKAGE).parts:
            continue
        for name in names_read_by_calls(ast.parse(path.read_text())):
            readers.setdefault(name, []).append(str(path.relative_to(REPO)))
    for path in port_units():
        for edit in tomllib.loads(path.read_text()).get("edits", []):
            for name in names_read_in_text(edit["replacement"]):
                readers.setdefault(name, []).append(str(path.relative_to(REPO)))
    return readers


def recipe_switches() -> set[str]:
    """The port switches serving/recipe.yaml and serving/launch.sh export."""
    env = {**load_recipe()["env"], **parse_launch_block(LAUNCH_SCRIPT.read_text()).env}
    return {name for name in env if is_port_switch_name(name)}


def test_every_switch_has_a_reader_or_is_declared_unread():
    readers = code_readers()
    guards = (PACKAGE / "settings" / "guards.py").read_text()
    unread = set()
    for name in SWITCHES:
        if name in GUARD_ONLY:
            assert f'"{name}"' in guards, f"{name}: its guard rule does not read it"
        elif name not in readers:
            unread.add(name)
    assert unread == UNREAD, {"unread now": sorted(unread), "declared": sorted(UNREAD), "readers": readers}


def test_every_switch_the_recipe_sets_is_read_on_hpu():
    on_hpu, anywhere = hpu_readers(), code_readers()
    switches = recipe_switches()
    assert switches >= set(SWITCHES) - GUARD_ONLY, sorted(switches)  # the recipe sets them all
    missing = {name: anywhere.get(name, []) for name in sorted(switches - GUARD_ONLY) if name not in on_hpu}
    assert not missing, f"recipe switches no code on HPU reads (their readers elsewhere): {missing}"


def test_a_switch_read_only_by_cpu_code_has_no_hpu_reader():
    # Without the port unit beam-exact-rounding, BEAM_EXACT_ROUNDING is read by the CPU experts,
    # the CPU dense rounding, the reference and the perplexity gate, none of which runs on HPU:
    # the recipe test above must then fail for it.
    without = hpu_readers([p for p in port_units() if p.stem != "beam-exact-rounding"])
    assert "BEAM_EXACT_ROUNDING" not in without, without
    assert "beam_hpu/runtime/fp8/portable_moe.py" in code_readers()["BEAM_EXACT_ROUNDING"]
    assert hpu_readers()["BEAM_EXACT_ROUNDING"] == ["beam_hpu.runtime.fp8.hpu_exact_rounding:activation_quantiser"]


def test_the_reader_finder_sees_the_forms_readers_take():
    source = ('from beam_hpu.settings import switches\n'
              'x = switches.current("BEAM_GRAMMAR_DEVICE_MASK", env)\n'
              'y = read_switch("BEAM_FSDPA_Q_TILE", {})\n'
              'z = other("BEAM_FSDPA_WS_GIB")\n')
    assert names_read_by_calls(ast.parse(source)) == {"BEAM_GRAMMAR_DEVICE_MASK", "BEAM_FSDPA_Q_TILE"}
    assert set(code_readers()) >= {"BEAM_GRAMMAR_DEVICE_MASK", "BEAM_FSDPA_Q_TILE", "BEAM_FSDPA_WS_GIB",
                                   "VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUT", "VLLM_BEAM_STREAM_TOOL_ARGS"}
    # Through a port edit's import and a same-module call (tiled_fsdpa_op -> fsdpa_tile_switches).
    assert hpu_readers()["BEAM_FSDPA_Q_TILE"] == ["beam_hpu.runtime.prefill.hpu_fsdpa_tiles:fsdpa_tile_switches"]


def test_moe_gather_is_read_on_hpu_only_through_its_port_unit():
    # BEAM_MOE_GATHER: the CPU portable experts read it too, but on HPU only beam-moe-gather's
    # edit (hpu_gather_limit -> gather_limit) does; without the unit the recipe's 1 would act on nothing.
    assert hpu_readers()["BEAM_MOE_GATHER"] == ["beam_hpu.runtime.fp8.hpu_moe_gather:gather_limit"]
    without = hpu_readers([p for p in port_units() if p.stem != "beam-moe-gather"])
    assert "BEAM_MOE_GATHER" not in without
    assert "beam_hpu/runtime/fp8/portable_moe.py" not in code_readers()["BEAM_MOE_GATHER"]  # via moe_gather
    assert "beam_hpu/runtime/fp8/hpu_moe_gather.py" in code_readers()["BEAM_MOE_GATHER"]


def test_window_kv_is_read_on_hpu_only_through_its_port_unit():
    # BEAM_WINDOW_KV: only beam-window-kv-cache's get_kv_cache_spec edit reads it (through
    # hpu_window_kv_enabled -> window_kv_enabled); without the unit the switch acts on nothing.
    assert hpu_readers()["BEAM_WINDOW_KV"] == ["beam_hpu.runtime.window_kv.hpu_cache:window_kv_enabled"]
    without = hpu_readers([p for p in port_units() if p.stem != "beam-window-kv-cache"])
    assert "BEAM_WINDOW_KV" not in without
    assert code_readers()["BEAM_WINDOW_KV"] == ["beam_hpu/runtime/window_kv/hpu_cache.py"]
