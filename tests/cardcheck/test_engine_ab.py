"""card-check's engine A/B settings as the node would run them, without a card: every switch's
settings read from serving/recipe.yaml, and the engine arguments and environment a node's engine
gets for each (the recipe's serve flags and env, the DFlash2 variant's config and bucket file)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from beam_hpu.cardcheck.engine_ab import CPU, Setting, ab_switches, cpu_model, engine_kwargs, measure_setting, setting_env
from serving.recipe import load_recipe

# vllm-gaudi's defaults for what recipe.yaml's env leaves unset (hpu_model_runner.py's graph split)
VLLM_DEFAULTS = {"VLLM_CONFIG_HIDDEN_LAYERS": "1"}


def test_every_switchs_first_setting_is_the_recipes_and_the_others_are_read_from_it():
    """The engine A/B measures the recipe's engine once and shares it as each switch's first
    setting: that holds only while each first setting restates recipe.yaml (or vllm-gaudi's
    default); the other settings are recipe.yaml's variants and levers."""
    recipe = load_recipe()
    recipe_env = {k: str(val) for k, val in recipe["env"].items()}
    switches = {ab.switch: ab for ab in ab_switches(recipe)}
    for ab in switches.values():
        first = ab.settings[0]
        assert not first.speculative and not first.warm, ab.switch
        for name, value in first.env.items():
            assert recipe_env.get(name, VLLM_DEFAULTS.get(name)) == value, (ab.switch, name)
        assert all(s.env or s.speculative for s in ab.settings[1:]), ab.switch
    assert switches["BEAM_MOE_GATHER"].settings[1].env == recipe["moe_gather"]["env"]
    assert [s.name for s in switches["VLLM_CONFIG_HIDDEN_LAYERS"].settings[1:]] == recipe["graph_split"]["settings"]
    warm = switches["PT_HPU_RECIPE_CACHE_CONFIG"].settings[1]
    assert warm.warm and warm.env["PT_HPU_RECIPE_CACHE_CONFIG"].endswith(
        recipe["recipe_cache"]["env"]["PT_HPU_RECIPE_CACHE_CONFIG"].split(",", 1)[1])


def test_a_node_engine_gets_the_recipes_flags_and_environment():
    recipe = load_recipe()
    kwargs = engine_kwargs("hpu", Setting("recipe"), None)
    assert (kwargs["tensor_parallel_size"], kwargs["enable_expert_parallel"], kwargs["load_format"],
            kwargs["block_size"]) == (8, True, "beam", 128)
    assert "speculative_config" not in kwargs and "tool_call_parser" not in kwargs
    env = setting_env("hpu", Setting("1", {"BEAM_MOE_GATHER": "1"}))
    assert {k: env[k] for k in recipe["env"] if k != "BEAM_MOE_GATHER"} == {
        k: v for k, v in recipe["env"].items() if k != "BEAM_MOE_GATHER"}
    assert env["BEAM_MOE_GATHER"] == "1" and env["PT_HPU_LAZY_MODE"] == "1"
    # DFlash2: the variant's drafter and drafts, its bucket file, no async scheduling
    drafted = engine_kwargs("hpu", Setting("dflash2", speculative=True), None)
    assert drafted["speculative_config"] == json.loads(recipe["dflash2"]["serve"]["speculative-config"])
    assert drafted["async_scheduling"] is False
    assert setting_env("hpu", Setting("dflash2", speculative=True))["VLLM_BUCKETING_FROM_FILE"] == \
        recipe["dflash2"]["env"]["VLLM_BUCKETING_FROM_FILE"]
    assert engine_kwargs("hpu", Setting("dflash2", speculative=True), "/models/d")["speculative_config"]["model"] == \
        "/models/d"
    # A synthetic Beam: vLLM's dummy loader, token ids only
    synthetic = engine_kwargs("hpu", Setting("recipe"), None, synthetic=True)
    assert (synthetic["load_format"], synthetic["skip_tokenizer_init"]) == ("dummy", True)


@pytest.mark.slow
def test_a_setting_whose_engine_does_not_start_is_named_with_the_engines_words(tmp_path):
    """A real vLLM-CPU start the port's launch guard refuses (a switch value it cannot read): the
    error names the setting and carries the guard's message naming the variable."""
    with pytest.raises(RuntimeError) as failed:
        measure_setting("cpu", cpu_model(tmp_path), Setting("maybe", {"BEAM_WINDOW_KV": "maybe"}), CPU, None, tmp_path)
    assert "'maybe'" in str(failed.value).splitlines()[0] and "BEAM_WINDOW_KV" in str(failed.value)


def test_the_recipe_is_found_from_outside_the_checkout(tmp_path):
    """`beam-hpu card-check` started in any directory reads the checkout's recipe (an editable
    install), not only with the repository as the working directory."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COOKBOOK")}
    proc = subprocess.run([sys.executable, "-c", "import beam_hpu; from beam_hpu.cardcheck.engine_ab import "
                           "cookbook_recipe; print(cookbook_recipe().__file__); print(beam_hpu.__file__)"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    recipe, package = proc.stdout.strip().splitlines()[-2:]
    # the checkout the installed package is (here or, from a worktree, the one installed)
    assert Path(recipe) == Path(package).resolve().parents[1] / "serving" / "recipe.py"
