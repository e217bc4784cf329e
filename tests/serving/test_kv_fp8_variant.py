"""The recipe's FP8 KV-cache variant (serving/launch-kv-fp8.sh, recipe.yaml `kv_fp8`): the flags it
adds, its refusal of an uncalibrated checkpoint, its steps naming real commands, its startup on HPU."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import torch

from beam_hpu.cli import main as cli
from beam_hpu.settings.guards import startup_problems
from serving import kv_capacity as kc
from serving.recipe import flags_as_vllm_args, load_recipe, recipe_flags

SERVING = Path(__file__).resolve().parents[2] / "serving"
RECIPE = load_recipe()
VARIANT = RECIPE["kv_fp8"]


def run_variant(tmp_path, model: Path, *extra):
    shutil.copy(SERVING / VARIANT["script"], tmp_path / "variant.sh")
    (tmp_path / "launch.sh").write_text("#!/usr/bin/env bash\nprintf '%s\\n' \"$@\"\n")
    (tmp_path / "launch.sh").chmod(0o755)
    return subprocess.run([str(tmp_path / "variant.sh"), str(model), *extra], capture_output=True, text=True,
                          env=dict(os.environ))


def test_the_variant_adds_exactly_the_flags_recipe_yaml_lists(tmp_path):
    model = tmp_path / "overlay"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"quantization_config": {"kv_cache_scheme": {"num_bits": 8}}}))
    out = run_variant(tmp_path, model, "--port", "8000")
    assert out.returncode == 0, out.stderr
    want = [w for flag, value in VARIANT["serve"].items() for w in (f"--{flag}", str(value))]
    assert out.stdout.splitlines() == [str(model), *want, "--port", "8000"]


def test_the_variant_refuses_a_checkpoint_without_calibrated_scales(tmp_path):
    model = tmp_path / "plain"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"quantization_config": {"kv_cache_scheme": None}}))
    out = run_variant(tmp_path, model)
    assert out.returncode == 2 and "no kv_cache_scheme" in out.stderr and out.stdout == ""


def test_the_steps_are_commands_beam_hpu_parses():
    for step in ("calibrate", "gate"):
        words = shlex.split(VARIANT[step])
        assert words[0] == "beam-hpu"
        try:
            cli([*words[1:], "--help"])
        except SystemExit as e:  # --help exits 0 after parsing every other flag
            assert e.code == 0, step
    assert "--kv-scales" in VARIANT["gate"] and "--fp8-max 240" in VARIANT["calibrate"]


def test_the_variant_starts_on_hpu_and_the_modelled_pool_is_kv_capacitys():
    args = {**flags_as_vllm_args(recipe_flags(RECIPE)), "kv_cache_dtype": VARIANT["serve"]["kv-cache-dtype"]}
    assert startup_problems({}, args, device_type="hpu") == []
    f = sum(kc.free_for_blocks(kc.layer_specs(kc.BEAM_501B_TP8, 128, torch.bfloat16), 6066, kc.MemoryFigures(0.0))) / 2
    fp8 = kc.capacity(kc.BEAM_501B_TP8, kc.MemoryFigures(f), 128, torch.float8_e4m3fn)
    assert VARIANT["kv_pool_tokens_modelled"] in range(fp8["tokens"] - 3 * 128, fp8["tokens"] + 3 * 128)
    assert VARIANT["per_sequence_tokens_at_16_modelled"] == kc.per_sequence_tokens(fp8["blocks"], 128, 16, 262_144)
