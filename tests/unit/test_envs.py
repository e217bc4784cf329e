"""The port's switches parse, validate and describe themselves; the startup guards refuse exactly
the launches the recipe's "What not to do" lists, naming the culprit."""

from __future__ import annotations

import re
from argparse import Namespace

import pytest

from beam_hpu import envs
from beam_hpu.envs import SWITCHES, StartupError, SwitchError, check_startup, startup_problems

RECIPE_ARGS = dict(
    max_model_len=262144,
    enforce_eager=False,
    reasoning_parser="beam",
    tool_call_parser="beam",
    chat_template_content_format="auto",
)

ISSUE_SWITCHES = {
    "BEAM_EXACT_ROUNDING",
    "BEAM_PREFILL_INFLIGHT",
    "BEAM_FSDPA_WS_GIB",
    "BEAM_FSDPA_Q_TILE",
    "BEAM_GRAMMAR_DEVICE_MASK",
    "VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUT",
    "VLLM_BEAM_STREAM_TOOL_ARGS",
}


def args(**overrides):
    return Namespace(**{**RECIPE_ARGS, **overrides})


def test_every_switch_of_the_issue_is_defined_and_described():
    assert ISSUE_SWITCHES <= set(SWITCHES)
    for switch in SWITCHES.values():
        assert envs.is_port_switch_name(switch.name)
        # A paragraph for the README, saying what each value of an on/off switch does.
        assert len(switch.description) > 200, switch.name
        if switch.parse is envs.parse_bool:
            assert re.search(r"\b1\b", switch.description) and re.search(r"\b0\b", switch.description)


def test_defaults_parse_and_are_what_the_recipe_sets():
    values = envs.read_switches({})
    assert values == {
        "BEAM_EXACT_ROUNDING": False,
        "BEAM_PREFILL_INFLIGHT": True,
        "BEAM_FSDPA_WS_GIB": 2.0,
        "BEAM_FSDPA_Q_TILE": 256,
        "BEAM_GRAMMAR_DEVICE_MASK": True,
        "VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUT": True,
        "VLLM_BEAM_STREAM_TOOL_ARGS": True,
        "BEAM_ALLOW_EAGER": False,
    }


@pytest.mark.parametrize("text, value", [("1", True), ("0", False), ("true", True), ("False", False), (" 1 ", True)])
def test_bool_switch_values(text, value):
    assert envs.read_switch("BEAM_GRAMMAR_DEVICE_MASK", {"BEAM_GRAMMAR_DEVICE_MASK": text}) is value


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
        envs.read_switch(name, {name: text})
    with pytest.raises(SwitchError, match=name):
        envs.read_switches({name: text})


@pytest.mark.parametrize("text, value", [("0", 0.0), ("2", 2.0), ("0.5", 0.5)])
def test_workspace_bound_values(text, value):
    assert envs.read_switch("BEAM_FSDPA_WS_GIB", {"BEAM_FSDPA_WS_GIB": text}) == value


@pytest.mark.parametrize("text, value", [("0", 0), ("128", 128), ("256", 256), ("4096", 4096)])
def test_q_tile_values(text, value):
    assert envs.read_switch("BEAM_FSDPA_Q_TILE", {"BEAM_FSDPA_Q_TILE": text}) == value


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
        envs.read_switches({name: "1"})


def test_other_beam_variables_are_not_ours_to_refuse():
    # e.g. the fixes tests' fault-injection knob, set in a real vLLM server's environment
    assert envs.read_switches({"BEAM_FIXES_TEST_FAIL_RANK": "1", "BEAM_HPU_CACHE": "/tmp"})


def test_unknown_name_is_not_read():
    with pytest.raises(SwitchError, match="not a switch"):
        envs.read_switch("BEAM_NOPE", {})


def test_every_bad_value_is_reported_at_once():
    with pytest.raises(SwitchError) as e:
        envs.read_switches({"BEAM_FSDPA_Q_TILE": "7", "BEAM_EXACT_ROUNDING": "maybe"})
    assert "BEAM_FSDPA_Q_TILE" in str(e.value) and "BEAM_EXACT_ROUNDING" in str(e.value)


def test_recipe_launch_starts():
    values = check_startup({"BEAM_FSDPA_WS_GIB": "2"}, args(), device_type="hpu")
    assert values["BEAM_FSDPA_WS_GIB"] == 2.0
    # A plain mapping of vLLM's argument names works as well as a Namespace.
    assert check_startup({}, dict(RECIPE_ARGS), device_type="hpu")["BEAM_FSDPA_Q_TILE"] == 256


@pytest.mark.parametrize("value", ["1", "0", ""])
def test_qkv_slice_mode_is_refused_whatever_its_value(value):
    problems = startup_problems({"PT_HPU_SDPA_QKV_SLICE_MODE_FWD": value}, args(), device_type="hpu")
    assert len(problems) == 1 and problems[0].startswith("PT_HPU_SDPA_QKV_SLICE_MODE_FWD is set")
    assert "sliding-window" in problems[0]


@pytest.mark.parametrize(
    "max_model_len, refused",
    [(262144, True), (32768, True), (32767, False), (8192, False), (None, True), (-1, True)],
)
def test_unbounded_fsdpa_workspace_is_refused_at_long_context(max_model_len, refused):
    env = {"BEAM_FSDPA_WS_GIB": "0"}
    problems = startup_problems(env, args(max_model_len=max_model_len), device_type="hpu")
    assert bool(problems) is refused
    if refused:
        assert "BEAM_FSDPA_WS_GIB=0" in problems[0] and "device memory" in problems[0]
    # Any bound at all is accepted at any length.
    assert not startup_problems({"BEAM_FSDPA_WS_GIB": "0.5"}, args(max_model_len=max_model_len), device_type="hpu")


def test_enforce_eager_is_refused_on_hpu_unless_overridden():
    problems = startup_problems({}, args(enforce_eager=True), device_type="hpu")
    assert len(problems) == 1 and "--enforce-eager" in problems[0] and "0.68 tokens/s" in problems[0]
    assert "BEAM_ALLOW_EAGER=1" in problems[0]
    assert not startup_problems({"BEAM_ALLOW_EAGER": "1"}, args(enforce_eager=True), device_type="hpu")
    # The CPU proving ground runs eager: nothing to refuse there.
    assert not startup_problems({}, args(enforce_eager=True), device_type="cpu")


@pytest.mark.parametrize(
    "reasoning, tool, refused",
    [
        ("beam", "beam", False),
        ("beam", None, False),
        ("", "beam", True),  # the tool parser alone would see stripped control tokens
        (None, "beam", True),
        (None, None, False),
        ("deepseek_r1", "hermes", False),  # no beam parser involved: not this port's business
        ("beam", "hermes", True),
        ("qwen3", "beam", True),
    ],
)
def test_beam_parser_is_not_combined_with_another(reasoning, tool, refused):
    problems = startup_problems({}, args(reasoning_parser=reasoning, tool_call_parser=tool), device_type="hpu")
    assert bool(problems) is refused
    if refused and reasoning:
        assert f"--reasoning-parser {reasoning}" in problems[0] and f"--tool-call-parser {tool}" in problems[0]
    elif refused:
        assert "--tool-call-parser beam without --reasoning-parser beam" in problems[0]


def test_openai_content_format_is_refused():
    problems = startup_problems({}, args(chat_template_content_format="openai"), device_type="hpu")
    assert len(problems) == 1 and "--chat-template-content-format openai" in problems[0]
    assert "HTTP 400" in problems[0]
    assert not startup_problems({}, args(chat_template_content_format="string"), device_type="hpu")


def test_check_startup_raises_with_every_culprit():
    env = {"PT_HPU_SDPA_QKV_SLICE_MODE_FWD": "1", "BEAM_FSDPA_WS_GIB": "0", "BEAM_FSDPA_Q_TILE": "3"}
    with pytest.raises(StartupError) as e:
        check_startup(env, args(enforce_eager=True, tool_call_parser="hermes"), device_type="hpu")
    message = str(e.value)
    for culprit in (
        "PT_HPU_SDPA_QKV_SLICE_MODE_FWD",
        "BEAM_FSDPA_Q_TILE",
        "--enforce-eager",
        "--tool-call-parser hermes",
    ):
        assert culprit in message, culprit
    # BEAM_FSDPA_Q_TILE is unreadable, so the switches are unknown: the workspace guard must not
    # guess from a half-read environment.
    assert "BEAM_FSDPA_WS_GIB=0 with" not in message
