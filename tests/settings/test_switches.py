"""The port's switches (beam_hpu.settings.switches) parse, validate and describe themselves."""

from __future__ import annotations

import re

import pytest

from beam_hpu.settings import switches
from beam_hpu.settings.switches import SWITCHES, SwitchError

ISSUE_SWITCHES = {
    "BEAM_EXACT_ROUNDING",
    "BEAM_PREFILL_INFLIGHT",
    "BEAM_FSDPA_WS_GIB",
    "BEAM_FSDPA_Q_TILE",
    "BEAM_GRAMMAR_DEVICE_MASK",
    "BEAM_MOE_GATHER",
    "BEAM_WINDOW_KV",
    "VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUT",
    "VLLM_BEAM_STREAM_TOOL_ARGS",
}




def test_every_switch_of_the_issue_is_defined_and_described():
    assert ISSUE_SWITCHES <= set(SWITCHES)
    for switch in SWITCHES.values():
        assert switches.is_port_switch_name(switch.name)
        # A paragraph for the README, saying what each value of an on/off switch does.
        assert len(switch.description) > 200, switch.name
        if switch.parse is switches.parse_bool:
            assert re.search(r"\b1\b", switch.description) and re.search(r"\b0\b", switch.description)


def test_defaults_parse_and_are_what_the_recipe_sets():
    values = switches.read_switches({})
    assert values == {
        "BEAM_EXACT_ROUNDING": False,
        "BEAM_PREFILL_INFLIGHT": True,
        "BEAM_FSDPA_WS_GIB": 2.0,
        "BEAM_FSDPA_Q_TILE": 256,
        "BEAM_GRAMMAR_DEVICE_MASK": True,
        "BEAM_MOE_GATHER": 0,
        "BEAM_WINDOW_KV": False,
        "VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUT": True,
        "VLLM_BEAM_STREAM_TOOL_ARGS": True,
        "BEAM_ALLOW_EAGER": False,
    }


@pytest.mark.parametrize("text, value", [("1", True), ("0", False), ("true", True), ("False", False), (" 1 ", True)])
def test_bool_switch_values(text, value):
    assert switches.read_switch("BEAM_GRAMMAR_DEVICE_MASK", {"BEAM_GRAMMAR_DEVICE_MASK": text}) is value


@pytest.mark.parametrize(
    "name, text",
    [
        ("BEAM_GRAMMAR_DEVICE_MASK", "2"),
        ("BEAM_GRAMMAR_DEVICE_MASK", "yes please"),
        ("VLLM_BEAM_STREAM_TOOL_ARGS", ""),
        ("BEAM_FSDPA_WS_GIB", "two"),
        ("BEAM_FSDPA_WS_GIB", "-1"),
        ("BEAM_FSDPA_WS_GIB", "nan"),
        ("BEAM_FSDPA_WS_GIB", "96"),
        ("BEAM_FSDPA_Q_TILE", "100"),
        ("BEAM_FSDPA_Q_TILE", "-128"),
        ("BEAM_FSDPA_Q_TILE", "256.0"),
    ],
)
def test_bad_values_raise_naming_the_variable(name, text):
    with pytest.raises(SwitchError, match=name):
        switches.read_switch(name, {name: text})
    with pytest.raises(SwitchError, match=name):
        switches.read_switches({name: text})


@pytest.mark.parametrize("text, value", [("0", 0.0), ("2", 2.0), ("0.5", 0.5)])
def test_workspace_bound_values(text, value):
    assert switches.read_switch("BEAM_FSDPA_WS_GIB", {"BEAM_FSDPA_WS_GIB": text}) == value


@pytest.mark.parametrize("text, value", [("0", 0), ("128", 128), ("256", 256), ("4096", 4096)])
def test_q_tile_values(text, value):
    assert switches.read_switch("BEAM_FSDPA_Q_TILE", {"BEAM_FSDPA_Q_TILE": text}) == value


@pytest.mark.parametrize(
    "name, meant",
    [
        ("BEAM_GRAMMAR_DEVICE_MASKS", "BEAM_GRAMMAR_DEVICE_MASK"),
        ("BEAM_FSDPA_QTILE", "BEAM_FSDPA_Q_TILE"),
        ("VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUTS", "VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUT"),
        ("BEAM_EXACT_ROUNDNG", "BEAM_EXACT_ROUNDING"),
    ],
)
def test_misspelt_switch_is_refused_not_ignored(name, meant):
    with pytest.raises(SwitchError, match=f"{name} is not a switch of the Beam port; did you mean {meant}"):
        switches.read_switches({name: "1"})


def test_other_beam_variables_are_not_ours_to_refuse():
    # e.g. the fixes tests' fault-injection knob, set in a real vLLM server's environment
    assert switches.read_switches({"BEAM_FIXES_TEST_FAIL_RANK": "1", "BEAM_HPU_CACHE": "/tmp"})


def test_unknown_name_is_not_read():
    with pytest.raises(SwitchError, match="not a switch"):
        switches.read_switch("BEAM_NOPE", {})


def test_every_bad_value_is_reported_at_once():
    with pytest.raises(SwitchError) as e:
        switches.read_switches({"BEAM_FSDPA_Q_TILE": "7", "BEAM_EXACT_ROUNDING": "maybe"})
    assert "BEAM_FSDPA_Q_TILE" in str(e.value) and "BEAM_EXACT_ROUNDING" in str(e.value)
