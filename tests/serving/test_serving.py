"""serving/: the bucket file regenerates byte for byte and lints clean, the linter catches what
vllm-gaudi would skip, drop or miss, and recipe.yaml, launch.sh and the published recipe agree on
every env var and flag (with the port's switches all defined and valid)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest

from beam_hpu.settings import guards, switches
from serving import lint_buckets, make_buckets
from serving.recipe import (
    flags_as_vllm_args,
    load_recipe,
    parse_launch_block,
    recipe_flags,
    recipe_geometry,
)

REPO = Path(__file__).resolve().parents[2]
SERVING = REPO / "serving"
LAUNCH = SERVING / "launch.sh"
# The published recipe text lives in the steering repository's shared/ next to this checkout.
SEED = REPO.parent / "shared" / "seeds" / "gaudi-recipe-beam-fp8.txt"

RECIPE = load_recipe()
GEOMETRY = recipe_geometry(RECIPE)
BUCKET_FILE = SERVING / RECIPE["buckets"]["file"]


# Bucket file ------------------------------------------------------------------------------------


def test_bucket_file_regenerates_byte_for_byte():
    assert BUCKET_FILE.read_bytes() == make_buckets.render(GEOMETRY, BUCKET_FILE.name).encode()
    assert make_buckets.main(["--check"]) == 0


def test_committed_bucket_file_lints_clean():
    assert lint_buckets.lint_bucket_text(BUCKET_FILE.read_text(), GEOMETRY) == []
    assert lint_buckets.main([str(BUCKET_FILE)]) == 0


def test_bucket_file_shape():
    buckets, problems = lint_buckets.parse_bucket_text(BUCKET_FILE.read_text())
    assert not problems
    decodes = {b.shape for b in buckets if b.query == 1}
    assert {b for b, _, _ in decodes} == {1, 2, 4, 8, 16}
    for batch in (1, 2, 4, 8, 16):
        assert len([d for d in decodes if d[0] == batch]) in (4, 5)
    prompts = [b.shape for b in buckets if b.query != 1]
    top = max(prompts, key=lambda s: s[2])
    assert top[2] * GEOMETRY.block_size == GEOMETRY.max_model_len  # the top point at 256K
    assert max(q for _, q, _ in prompts) == GEOMETRY.max_num_batched_tokens


def mutate(drop: str | None = None, add: str | None = None) -> str:
    lines = BUCKET_FILE.read_text().splitlines()
    if drop is not None:
        matches = [line for line in lines if line.startswith(drop)]
        assert len(matches) == 1, drop
        lines.remove(matches[0])
    if add is not None:
        lines.append(add)
    return "\n".join(lines) + "\n"


def added_line() -> int:
    return len(BUCKET_FILE.read_text().splitlines()) + 1


@pytest.mark.parametrize(
    "text_of, expected",
    [
        (lambda: mutate(drop="(1, 4096, 2048)"), "a 2-token chunk after 2048 context blocks falls in no bucket"),
        (lambda: mutate(drop="(16, 1,"), "16 sequences with up to 32768 KV blocks fall in no bucket"),
        (lambda: mutate(add="(1, 1, range(32, 2048, 64))"), "the limit is 25"),
        (lambda: mutate(add="(1, 1, [2, 3])"), "{n}: decode: the smallest bucket for batch 1, 2 blocks"),
        (lambda: mutate(add="(1, 128, 0"), "{n}: vllm-gaudi skips it: not a literal"),
        (lambda: mutate(add="(1, 1, range(1, 20000))"), "{n}: vllm-gaudi skips it"),
        (lambda: mutate(add="[1, 128, 0]"), "{n}: vllm-gaudi skips it: not a tuple of 3"),
        (lambda: mutate(add="(1, 128, '0')"), "{n}: '0' is not a non-negative int"),
        (lambda: mutate(add="(1, 128, 1.5)"), "{n}: 1.5 is not a non-negative int"),
        (lambda: mutate(add="(2, 4096, 0)"), "{n}: vllm-gaudi drops (2, 4096, 0): batch * query 8192"),
        (lambda: mutate(add="(1, 128, 2049)"), "{n}: vllm-gaudi drops (1, 128, 2049): context beyond"),
        (lambda: mutate(add="(4, 1, 2)"), "{n}: vllm-gaudi drops (4, 1, 2): fewer blocks than sequences"),
        (lambda: mutate(add="(2, 1, 5000)"), "{n}: vllm-gaudi changes (2, 1, 5000): cut to 4096 blocks"),
        (lambda: mutate(add="(32, 1, 65536)"), "{n}: (32, 1, 65536): batch 32 is never formed"),
        (lambda: mutate(add="(1, 128, [0, 1])"), "{n}: (1, 128, 0) is already listed on line"),
    ],
)
def test_linter_reports_the_offending_line(text_of, expected, tmp_path, capsys):
    problems = lint_buckets.lint_bucket_text(text_of(), GEOMETRY)
    wanted = expected.format(n=added_line())
    assert any(p.startswith(wanted) or wanted in p for p in problems), problems
    bad = tmp_path / "buckets.txt"
    bad.write_text(text_of())
    assert lint_buckets.main([str(bad)]) == 1
    assert wanted in capsys.readouterr().err


def test_range_expansion_and_cartesian_product():
    # vllm-gaudi's own example file and what its file strategy makes of it (notes, section 4).
    text = "# comment\n(1, 2048, 0)\n(1, [256, 512], [0, 4, 8])  # trailing\n\n(64, 1, 1024)\n(32, 1, 512)\n(1, 1, range(256, 512, 32))\n"
    buckets, problems = lint_buckets.parse_bucket_text(text)
    assert not problems
    prompts = sorted(b.shape for b in buckets if b.query != 1)
    decodes = sorted(b.shape for b in buckets if b.query == 1)
    assert prompts == [(1, 256, 0), (1, 256, 4), (1, 256, 8), (1, 512, 0), (1, 512, 4), (1, 512, 8), (1, 2048, 0)]
    assert decodes == [(1, 1, n) for n in range(256, 512, 32)] + [(32, 1, 512), (64, 1, 1024)]
    assert {b.line for b in buckets if b.shape == (1, 512, 8)} == {3}


def _load_vllm_gaudi_bucketing(root: Path):
    """vllm-gaudi's bucketing package from a source tree, with its logger/config imports stubbed."""
    config = types.SimpleNamespace(
        merged_prefill=False,
        use_contiguous_pa=False,
        VLLM_BUCKETING_FROM_FILE=None,
        bucketing_strategy="exp",
        PT_HPU_SDPA_QKV_SLICE_MODE_FWD=False,
        VLLM_PROMPT_QUERY_BUCKET_MIN=None,
        VLLM_PROMPT_CTX_BUCKET_MAX=None,
    )
    for phase, dims in (("PROMPT", ("BS", "SEQ")), ("DECODE", ("BS", "BLOCK"))):
        for dim in dims:
            for part in ("MIN", "STEP", "MAX"):
                setattr(config, f"VLLM_{phase}_{dim}_BUCKET_{part}", None)
    import logging

    stubs = {
        "vllm_gaudi": types.ModuleType("vllm_gaudi"),
        "vllm_gaudi.extension": types.ModuleType("vllm_gaudi.extension"),
        "vllm_gaudi.extension.logger": types.SimpleNamespace(logger=lambda: logging.getLogger("vllm_gaudi_stub")),
        "vllm_gaudi.extension.runtime": types.SimpleNamespace(get_config=lambda: config),
        "vllm_gaudi.extension.config": types.SimpleNamespace(boolean=lambda x: x.lower() in ("1", "true")),
    }
    stubs["vllm_gaudi"].__path__ = [str(root / "vllm_gaudi")]
    stubs["vllm_gaudi.extension"].__path__ = [str(root / "vllm_gaudi" / "extension")]
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        import importlib

        common = importlib.import_module("vllm_gaudi.extension.bucketing.common")
        files = importlib.import_module("vllm_gaudi.extension.bucketing.file_strategy")
        return common, files
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _vllm_gaudi_root() -> Path:
    root = os.environ.get("GAUDI_FIXES_ROOT")
    if not root or not (Path(root) / "vllm_gaudi" / "extension" / "bucketing" / "common.py").exists():
        pytest.skip("needs a vllm-gaudi source tree in GAUDI_FIXES_ROOT")
    return Path(root)


def test_prompt_buckets_are_vllm_gaudis_own_plus_the_top_point():
    common, _ = _load_vllm_gaudi_bucketing(_vllm_gaudi_root())
    manager = common.HPUBucketingManager()
    manager.initialize(
        max_num_seqs=GEOMETRY.max_num_seqs,
        max_num_prefill_seqs=GEOMETRY.max_prefill_batch_size,
        block_size=GEOMETRY.block_size,
        max_num_batched_tokens=GEOMETRY.max_num_batched_tokens,
        max_model_len=GEOMETRY.max_model_len,
    )
    manager.generate_prompt_buckets()
    ours = set(make_buckets.prompt_buckets(GEOMETRY))
    top = (1, GEOMETRY.max_num_batched_tokens, -(-(GEOMETRY.max_model_len - 1) // GEOMETRY.block_size))
    assert ours == set(manager.prompt_buckets) | {top}


def test_linter_reads_the_file_as_vllm_gaudis_file_strategy_does():
    _, files = _load_vllm_gaudi_bucketing(_vllm_gaudi_root())
    strategy = files.FileBucketingStrategy()
    buckets, _ = lint_buckets.parse_bucket_text(BUCKET_FILE.read_text())
    for is_prompt in (True, False):
        theirs = strategy.get_buckets(str(BUCKET_FILE), is_prompt)
        assert sorted(b.shape for b in buckets if (b.query != 1) == is_prompt) == theirs


# Launch block: recipe.yaml, launch.sh and the published recipe ------------------------------------

LAUNCH_BLOCK = parse_launch_block(LAUNCH.read_text())


def published_recipe():
    if not SEED.exists():
        pytest.skip(f"the published recipe text is not next to this checkout ({SEED})")
    return parse_launch_block(SEED.read_text())


def test_recipe_yaml_env_values_are_strings():
    # YAML would read a bare true or 0.4 as bool/float and they would no longer compare as exported.
    assert all(isinstance(v, str) for v in RECIPE["env"].values())


def test_launch_script_and_recipe_yaml_agree():
    assert LAUNCH_BLOCK.env == RECIPE["env"]
    assert LAUNCH_BLOCK.flags == recipe_flags(RECIPE)
    assert list(LAUNCH_BLOCK.flags) == list(recipe_flags(RECIPE))  # same order, for reading side by side
    assert LAUNCH_BLOCK.fix_profile == RECIPE["fix_profile"]
    assert LAUNCH_BLOCK.model == "$MODEL" and LAUNCH_BLOCK.extra_args == ['"$@"']


# Switches the port's launch block carries that the published recipe text does not yet: its
# Verified and Performance figures ran without them, so the text gains them with a card run.
NOT_YET_PUBLISHED = {
    "BEAM_MOE_GATHER": "0",  # off: the stock fused op, as the published run; opt-in variant moe_gather
    "BEAM_WINDOW_KV": "0",  # off, as the published run (stock cache); listed so the launch sets every switch
}


def test_the_launch_turns_on_nothing_the_published_run_did_not_measure():
    """A switch the Verified figures ran without is at its off value: the node is never slower or
    different from what the published figures measured until a card says otherwise."""
    for name in NOT_YET_PUBLISHED:
        assert switches.read_switch(name, LAUNCH_BLOCK.env) in (0, False), name


def test_the_moe_gather_variant_turns_on_only_its_switch(tmp_path):
    env = fake_bin(tmp_path, fix_exit=0)
    run = subprocess.run([str(LAUNCH.parent / "launch-moe-gather.sh"), "/models/beam"], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    served_env = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    want = {**RECIPE["env"], **RECIPE["moe_gather"]["env"]}
    assert {k: served_env.get(k) for k in want} == want and want["BEAM_MOE_GATHER"] == "1"
    assert (tmp_path / "argv").read_text().splitlines()[:2] == ["serve", "/models/beam"]


def test_published_recipe_agrees_with_both():
    seed = published_recipe()
    assert RECIPE["env"] == LAUNCH_BLOCK.env
    assert {**seed.env, **NOT_YET_PUBLISHED} == RECIPE["env"]
    assert not set(NOT_YET_PUBLISHED) & set(seed.env), "published now: drop it from NOT_YET_PUBLISHED"
    assert seed.flags == recipe_flags(RECIPE) == LAUNCH_BLOCK.flags
    assert seed.model == RECIPE["model"]
    assert seed.fix_profile == RECIPE["fix_profile"] == LAUNCH_BLOCK.fix_profile


def test_bucket_file_named_by_the_launch_is_the_generated_one():
    path = LAUNCH_BLOCK.env["VLLM_BUCKETING_FROM_FILE"]
    assert Path(path).name == BUCKET_FILE.name and BUCKET_FILE.exists()
    assert path.endswith("/serving/" + BUCKET_FILE.name)


def test_geometry_comes_from_the_flags():
    flags = LAUNCH_BLOCK.flags
    assert GEOMETRY.block_size == int(flags["--block-size"])
    assert GEOMETRY.max_model_len == int(flags["--max-model-len"])
    assert GEOMETRY.max_num_seqs == int(flags["--max-num-seqs"])
    assert GEOMETRY.max_num_batched_tokens == int(flags["--max-num-batched-tokens"])


def test_sliding_window_is_beams():
    from beam_hpu.model.config import beam_config_class

    assert GEOMETRY.sliding_window == beam_config_class()().sliding_window


def test_port_switches_in_the_launch_are_defined_valid_and_start():
    port_vars = {name for name in LAUNCH_BLOCK.env if switches.is_port_switch_name(name)}
    assert port_vars <= set(switches.SWITCHES)
    # The recipe sets every switch of the port explicitly (the override for eager aside).
    assert set(switches.SWITCHES) - port_vars == {"BEAM_ALLOW_EAGER"}
    values = switches.read_switches(LAUNCH_BLOCK.env)
    assert all(values[name] == switches.read_switch(name, LAUNCH_BLOCK.env) for name in port_vars)
    guards.check_startup(LAUNCH_BLOCK.env, flags_as_vllm_args(LAUNCH_BLOCK.flags), device_type="hpu")


# launch.sh run for real, with a stand-in `vllm` and fix step ----------------------------------------


def fake_bin(tmp_path: Path, fix_exit: int):
    cookbook = tmp_path / "cookbook"
    (cookbook / "fixes").mkdir(parents=True)
    (cookbook / "fixes" / "apply_all.py").write_text(
        f"import sys, pathlib\npathlib.Path({str(tmp_path / 'fixes-ran')!r}).write_text(' '.join(sys.argv[1:]))\nsys.exit({fix_exit})\n"
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    vllm = bin_dir / "vllm"
    vllm.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/argv\nenv > {tmp_path}/env\n')
    vllm.chmod(vllm.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "COOKBOOK": str(cookbook)}
    return env


def test_launch_script_runs_the_fix_step_then_vllm_serve(tmp_path):
    env = fake_bin(tmp_path, fix_exit=0)
    run = subprocess.run([str(LAUNCH), "/models/beam", "--port", "8000"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "fixes-ran").read_text() == "--profile v0.30.0"
    argv = (tmp_path / "argv").read_text().splitlines()
    expected = ["serve", "/models/beam"]
    for flag, value in recipe_flags(RECIPE).items():
        expected += [flag] if value is True else [flag, value]
    assert argv == expected + ["--port", "8000"]
    served_env = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    assert {k: served_env.get(k) for k in RECIPE["env"]} == RECIPE["env"]


def test_launch_script_stops_when_the_fix_step_fails(tmp_path):
    env = fake_bin(tmp_path, fix_exit=3)
    run = subprocess.run([str(LAUNCH), "/models/beam"], env=env, capture_output=True, text=True)
    assert run.returncode == 1 and not (tmp_path / "argv").exists()


def test_launch_script_needs_a_model():
    run = subprocess.run([str(LAUNCH)], capture_output=True, text=True)
    assert run.returncode == 2 and "usage" in run.stderr
