"""The recipe's opt-in speculative variant (serving/launch-speculative.sh, recipe.yaml `speculative`)
and the startup guard for speculation on Gaudi (beam_hpu.settings.guards.speculation_on_hpu)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from beam_hpu.settings.guards import HPU_DRAFT_METHODS, check_startup, startup_problems
from serving.recipe import flags_as_vllm_args, load_recipe, recipe_flags

REPO = Path(__file__).resolve().parents[2]
SERVING = REPO / "serving"
RECIPE = load_recipe()
VARIANT = RECIPE["speculative"]


def launch_args(tmp_path, *extra, env=None) -> list[str]:
    """What launch-speculative.sh hands launch.sh: run it next to a launch.sh that prints its argv."""
    shutil.copy(SERVING / VARIANT["script"], tmp_path / "variant.sh")
    (tmp_path / "launch.sh").write_text("#!/usr/bin/env bash\nprintf '%s\\n' \"$@\"\n")
    (tmp_path / "launch.sh").chmod(0o755)
    out = subprocess.run([str(tmp_path / "variant.sh"), "MODEL", *extra], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})})
    return out.stdout.splitlines()


def test_the_variant_adds_exactly_the_flags_recipe_yaml_lists(tmp_path):
    argv = launch_args(tmp_path, "--port", "8000")
    want = [word for flag, value in VARIANT["serve"].items()
            for word in ([f"--{flag}"] if value is True else [f"--{flag}", str(value)])]
    assert argv == ["MODEL", *want, "--port", "8000"]
    assert json.loads(VARIANT["serve"]["speculative-config"])["method"] == "ngram"


def test_the_variant_takes_another_config_from_the_environment(tmp_path):
    eagle = '{"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}'
    argv = launch_args(tmp_path, env={"SPECULATIVE_CONFIG": eagle})
    assert argv[argv.index("--speculative-config") + 1] == eagle


def variant_args(**overrides) -> dict:
    """recipe.yaml's flags with the variant's applied as argparse would (the later flag wins)."""
    args = flags_as_vllm_args(recipe_flags(RECIPE))
    args["async_scheduling"] = False  # --no-async-scheduling
    args["speculative_config"] = json.loads(VARIANT["serve"]["speculative-config"])
    return {**args, **overrides}


def test_the_variant_runs_on_cpu():
    check_startup({}, variant_args(), device_type="cpu")


def test_the_variant_starts_on_hpu():
    # Beam's grammar steps verify their drafts through the port patch beam-grammar-verify
    # (tests/runtime/speculative/test_tree_grammar_verify.py), sampled rows through beam-sampled-verify
    # (tests/runtime/speculative/test_tree_sampled_verify.py); the variant turns async scheduling off.
    assert startup_problems({}, variant_args(), device_type="hpu") == []
    check_startup({}, variant_args(), device_type="hpu")


def test_async_scheduling_and_unsupported_methods_are_named():
    problems = startup_problems({}, variant_args(async_scheduling=True, speculative_config='{"method": "suffix"}'),
                                device_type="hpu")
    assert any(p.startswith("--speculative-config method 'suffix' on HPU") for p in problems)
    assert any(p.startswith("--async-scheduling with --speculative-config on HPU") for p in problems)
    for method in HPU_DRAFT_METHODS:
        problems = startup_problems({}, variant_args(speculative_config={"method": method}), device_type="hpu")
        assert not any("method" in p for p in problems), method


def test_the_recipe_without_speculation_is_not_affected():
    check_startup({}, flags_as_vllm_args(recipe_flags(RECIPE)), device_type="hpu")


def test_the_bucket_linter_counts_the_graphs_speculation_adds():
    # By hand, max_model_len 1024 / block 128 = 8 blocks a sequence, 1 draft (2 rows a sequence):
    # (1, 1, 4) gives (2, 1, 4) and (2, 1, 8); (2, 1, 8) gives (4, 1, 8) and (4, 1, 16); (2, 1, 8) twice
    from serving.lint_buckets import speculative_decode_buckets
    from serving.recipe import Geometry

    g = Geometry(block_size=128, max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=2048,
                 max_prefill_batch_size=1, sliding_window=0, max_decode_graphs=4)
    assert speculative_decode_buckets({(1, 1, 4), (2, 1, 8)}, 1, g) == {
        (1, 1, 4), (2, 1, 8), (2, 1, 4), (4, 1, 8), (4, 1, 16)}
    # the cap: 2 rows at max_model_len hold 16 blocks, and no row fits in fewer blocks than rows
    assert speculative_decode_buckets({(1, 1, 8)}, 3, g) == {(1, 1, 8), (4, 1, 8), (4, 1, 32)}
    assert speculative_decode_buckets({(4, 1, 8)}, 1, g) == {(4, 1, 8), (8, 1, 8), (8, 1, 16)}
    assert speculative_decode_buckets({(8, 1, 8)}, 1, g) == {(8, 1, 8), (16, 1, 16)}


def test_lint_buckets_speculative_refuses_the_recipes_file_and_passes_the_variants():
    # The recipe's bucket file is clean for the recipe; under the variant (4 drafts) vllm-gaudi
    # prepares three graphs per decode seed, over the graph limit: refused, naming the file, the
    # count and the limit. The variant's own file (the default with --speculative) passes.
    import sys

    base = SERVING / RECIPE["buckets"]["file"]
    plain = subprocess.run([sys.executable, "-m", "serving.lint_buckets"], cwd=REPO, capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr
    spec = subprocess.run([sys.executable, "-m", "serving.lint_buckets", "--speculative", str(base)], cwd=REPO,
                          capture_output=True, text=True)
    k = json.loads(VARIANT["serve"]["speculative-config"])["num_speculative_tokens"]
    assert spec.returncode == 1
    assert (f"{base}: decode: with {k} speculative tokens vllm-gaudi prepares 69 decode buckets from these 23 "
            f"(batch x {k + 1} verify rows), each a captured graph; the limit is 25") in spec.stderr
    own = subprocess.run([sys.executable, "-m", "serving.lint_buckets", "--speculative"], cwd=REPO,
                         capture_output=True, text=True)
    assert own.returncode == 0 and own.stderr == "", own.stderr


# The variant's own bucket file ------------------------------------------------------------------

VARIANT_FILE = SERVING / VARIANT["buckets"]["file"]
DRAFTS = json.loads(VARIANT["serve"]["speculative-config"])["num_speculative_tokens"]


def test_the_variants_bucket_file_regenerates_byte_for_byte(tmp_path):
    from serving import make_buckets
    from serving.recipe import recipe_geometry

    assert VARIANT_FILE.name != RECIPE["buckets"]["file"]
    text = VARIANT_FILE.read_text()
    assert text == make_buckets.render(recipe_geometry(RECIPE), VARIANT_FILE.name, speculative=True)
    assert "# Generated by `python -m serving.make_buckets --speculative` from serving/recipe.yaml" in text
    assert make_buckets.main(["--speculative", "--check"]) == 0
    stale = tmp_path / VARIANT_FILE.name
    stale.write_text(text.replace("(16, 1, [512, ", "(16, 1, [1024, "))
    assert make_buckets.main(["--speculative", "--check", "--out", str(stale)]) == 1


def test_the_variants_file_keeps_the_prompt_buckets_and_fits_the_graph_limit_at_any_k():
    from serving.lint_buckets import lint_bucket_text, parse_bucket_text, speculative_decode_buckets
    from serving.recipe import recipe_geometry

    g = recipe_geometry(RECIPE)
    ours, _ = parse_bucket_text(VARIANT_FILE.read_text())
    base, _ = parse_bucket_text((SERVING / RECIPE["buckets"]["file"]).read_text())
    assert {b.shape for b in ours if b.query != 1} == {b.shape for b in base if b.query != 1}
    seeds = {b.shape for b in ours if b.query == 1}
    assert {b for b, _, _ in seeds} == {1, 4, 16}
    # lint_bucket_text checks every batch 1..16 at up to 256K a sequence falls in a seed, and the
    # graphs vllm-gaudi prepares at k drafts against the limit; a draft count the variant may be
    # given (SPECULATIVE_CONFIG) makes no more than three graphs a seed
    for k in (1, 2, 3, DRAFTS, 7):
        assert lint_bucket_text(VARIANT_FILE.read_text(), g, k) == [], k
        assert len(speculative_decode_buckets(seeds, k, g)) <= 3 * len(seeds) <= g.max_decode_graphs
    assert len(speculative_decode_buckets(seeds, DRAFTS, g)) == 24


def fake_vllm(tmp_path: Path) -> dict:
    """PATH and COOKBOOK for launch.sh with a `vllm` that records its argv and env, and a fix step
    that passes."""
    (tmp_path / "cookbook" / "fixes").mkdir(parents=True)
    (tmp_path / "cookbook" / "fixes" / "apply_all.py").write_text("import sys\nsys.exit(0)\n")
    (tmp_path / "bin").mkdir()
    vllm = tmp_path / "bin" / "vllm"
    vllm.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/argv\nenv > {tmp_path}/env\n')
    vllm.chmod(0o755)
    return {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "COOKBOOK": str(tmp_path / "cookbook")}


def served_env(tmp_path: Path) -> dict:
    return dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)


def test_the_variant_serves_with_its_own_bucket_file_through_launch_sh(tmp_path):
    env = fake_vllm(tmp_path)
    run = subprocess.run([str(SERVING / VARIANT["script"]), "/models/beam"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    path = VARIANT["env"]["VLLM_BUCKETING_FROM_FILE"]
    assert served_env(tmp_path)["VLLM_BUCKETING_FROM_FILE"] == path
    assert path.endswith("/serving/" + VARIANT_FILE.name)
    # the image path resolves in the repository layout (ports/beam-1-0/serving -> serving/)
    local = REPO / path[len("/opt/gaudi-cookbook/"):]
    assert local.resolve() == VARIANT_FILE.resolve() and local.is_file()
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[-3:] == ["--no-async-scheduling", "--speculative-config", VARIANT["serve"]["speculative-config"]]
    # every other env value is the recipe's; launch.sh alone keeps the recipe's file
    assert {k: v for k, v in served_env(tmp_path).items() if k in RECIPE["env"]} == {
        **RECIPE["env"], **VARIANT["env"]}
    assert subprocess.run([str(SERVING / "launch.sh"), "/models/beam"], env=env).returncode == 0
    assert served_env(tmp_path)["VLLM_BUCKETING_FROM_FILE"] == RECIPE["env"]["VLLM_BUCKETING_FROM_FILE"]
