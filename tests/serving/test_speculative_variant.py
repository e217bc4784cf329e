"""The recipe's opt-in draft variants, speculative (serving/launch-speculative.sh, recipe.yaml
`speculative`) and DFlash2 (serving/launch-dflash2.sh, recipe.yaml `dflash2`), and the startup guard
for speculation on Gaudi (beam_hpu.settings.guards.speculation_on_hpu)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from beam_hpu.settings.guards import HPU_DRAFT_METHODS, bucket_file_drafts, check_startup, startup_problems
from beam_hpu.tiny.dflash2_drafter import DFLASH2_DIR
from serving.recipe import flags_as_vllm_args, load_recipe, recipe_flags

REPO = Path(__file__).resolve().parents[2]
SERVING = REPO / "serving"
RECIPE = load_recipe()
VARIANT = RECIPE["speculative"]
# recipe.yaml's sections that serve with drafts, and the method each serves by default.
METHODS = {"speculative": "ngram", "dflash2": "dflash"}
# The env var each variant's script takes another drafter or config from, and a value for it with
# what the script must hand on.
OTHER_CONFIG = {
    "speculative": ("SPECULATIVE_CONFIG", '{"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}',
                    '{"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}'),
    "dflash2": ("DFLASH2_DRAFTER", "/models/my drafter",
                '{"method": "dflash", "model": "/models/my drafter", "num_speculative_tokens": 7}'),
}


@pytest.fixture(params=sorted(METHODS))
def variant(request) -> str:
    return request.param


def local_file(image_path: str) -> Path:
    """The repository file an image path names (ports/beam-1-0/serving -> serving/)."""
    return REPO / image_path[len("/opt/gaudi-cookbook/"):]


def launch_args(tmp_path, *extra, env=None, variant="speculative", check=True):
    """What a variant's script hands launch.sh: run it next to a launch.sh that prints its argv."""
    shutil.copy(SERVING / RECIPE[variant]["script"], tmp_path / "variant.sh")
    (tmp_path / "launch.sh").write_text("#!/usr/bin/env bash\nprintf '%s\\n' \"$@\"\n")
    (tmp_path / "launch.sh").chmod(0o755)
    out = subprocess.run([str(tmp_path / "variant.sh"), "MODEL", *extra], capture_output=True, text=True, check=check,
                         env={**os.environ, **(env or {})})
    return out.stdout.splitlines() if check else out


def test_the_variant_adds_exactly_the_flags_recipe_yaml_lists(tmp_path, variant):
    section = RECIPE[variant]
    argv = launch_args(tmp_path, "--port", "8000", variant=variant)
    want = [word for flag, value in section["serve"].items()
            for word in ([f"--{flag}"] if value is True else [f"--{flag}", str(value)])]
    assert argv == ["MODEL", *want, "--port", "8000"]
    assert json.loads(section["serve"]["speculative-config"])["method"] == METHODS[variant]


def test_the_variant_takes_another_config_from_the_environment(tmp_path, variant):
    name, value, handed = OTHER_CONFIG[variant]
    argv = launch_args(tmp_path, env={name: value}, variant=variant)
    assert argv[argv.index("--speculative-config") + 1] == handed


def test_the_dflash2_variant_refuses_a_drafter_it_cannot_quote(tmp_path):
    for drafter in ('/models/a"b', "/models/a\\b"):
        run = launch_args(tmp_path, env={"DFLASH2_DRAFTER": drafter}, variant="dflash2", check=False)
        assert run.returncode == 2 and "DFLASH2_DRAFTER must not hold" in run.stderr and run.stdout == ""


def test_the_dflash2_variant_has_a_usage_line(tmp_path):
    run = subprocess.run([str(SERVING / RECIPE["dflash2"]["script"])], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.startswith("usage: [DFLASH2_DRAFTER=DIR_OR_HUB_ID] ")


def variant_args(variant="speculative", **overrides) -> dict:
    """recipe.yaml's flags with the variant's applied as argparse would (the later flag wins); the
    DFlash2 drafter is the committed tiny one (the recipe's hub id is not on this host)."""
    args = flags_as_vllm_args(recipe_flags(RECIPE))
    args["async_scheduling"] = False  # --no-async-scheduling
    args["speculative_config"] = json.loads(RECIPE[variant]["serve"]["speculative-config"])
    if variant == "dflash2":
        args["speculative_config"]["model"] = str(DFLASH2_DIR)
    return {**args, **overrides}


def variant_env(variant) -> dict:
    """The variant's VLLM_BUCKETING_FROM_FILE, at its repository path."""
    return {"VLLM_BUCKETING_FROM_FILE": str(local_file(RECIPE[variant]["env"]["VLLM_BUCKETING_FROM_FILE"]))}


def test_the_variant_runs_on_cpu(variant):
    check_startup(variant_env(variant), variant_args(variant), device_type="cpu")


def test_the_variant_starts_on_hpu(variant):
    # Beam's grammar steps verify their drafts through the port patch beam-grammar-verify
    # (tests/runtime/speculative/test_tree_grammar_verify.py), sampled rows through beam-sampled-verify
    # (tests/runtime/speculative/test_tree_sampled_verify.py); the variant turns async scheduling off.
    assert startup_problems(variant_env(variant), variant_args(variant), device_type="hpu") == []
    check_startup(variant_env(variant), variant_args(variant), device_type="hpu")


def test_the_dflash2_variants_file_holds_it_to_its_draft_count():
    # the file's header records the recipe's count, and the guard refuses another with it on HPU
    k = json.loads(RECIPE["dflash2"]["serve"]["speculative-config"])["num_speculative_tokens"]
    assert bucket_file_drafts(local_file(RECIPE["dflash2"]["env"]["VLLM_BUCKETING_FROM_FILE"]).read_text()) == k
    assert bucket_file_drafts(local_file(VARIANT["env"]["VLLM_BUCKETING_FROM_FILE"]).read_text()) is None
    other = variant_args("dflash2")
    other["speculative_config"]["num_speculative_tokens"] = k - 4
    problems = startup_problems(variant_env("dflash2"), other, device_type="hpu")
    assert len(problems) == 1 and problems[0].startswith(f"--speculative-config num_speculative_tokens {k - 4} ")


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


def test_lint_buckets_dflash2_counts_the_drafter_graphs_and_refuses_both_other_files():
    # At 7 drafts the DFlash2 proposer adds one block graph per padded batch: the recipe's file
    # gives 58 + 5, the speculative variant's 24 + 4 (within the limit without them); the
    # DFlash2 variant's own file (the default with --dflash2) 21 + 4 = 25 and passes.
    import sys

    def lint(*argv):
        return subprocess.run([sys.executable, "-m", "serving.lint_buckets", *argv], cwd=REPO, capture_output=True,
                              text=True)

    k = json.loads(RECIPE["dflash2"]["serve"]["speculative-config"])["num_speculative_tokens"]
    assert k == 7
    for name, seeds, prepared, batches in ((RECIPE["buckets"]["file"], 23, 58, "1, 2, 4, 8, 16"),
                                           (VARIANT["buckets"]["file"], 8, 24, "1, 4, 8, 16")):
        run = lint("--dflash2", str(SERVING / name))
        drafter = len(batches.split(", "))
        assert run.returncode == 1
        assert (f"{SERVING / name}: decode: with 7 speculative tokens vllm-gaudi prepares {prepared} decode buckets "
                f"from these {seeds} (batch x 8 verify rows), each a captured graph, and the DFlash2 drafter captures "
                f"{drafter} block graphs (padded batches {batches}): {prepared + drafter} graphs; the limit is 25 "
                "(recipe.yaml buckets.max_decode_graphs); the variant's file has fewer decode seeds "
                "(python -m serving.make_buckets --dflash2)") in run.stderr, run.stderr
    assert lint("--speculative", str(SERVING / VARIANT["buckets"]["file"])).returncode == 0
    own = lint("--dflash2")
    assert own.returncode == 0 and own.stderr == "", own.stderr
    # the window-KV files have no DFlash2 variant: said, not a missing file
    run = lint("--dflash2", "--window-kv")
    assert run.returncode == 2 and "--window-kv has no file for the dflash2 variant" in run.stderr


def test_the_drafter_runs_at_each_batch_a_decode_step_is_padded_to():
    # By hand, max_model_len 1024 / block 128 = 8 blocks a sequence, k = 1: seeds (1, 1, 8) and
    # (4, 1, 32) prepare (2, 1, 8), (2, 1, 16), (8, 1, 32), (8, 1, 64). A verify step of 1 sequence
    # pads to seed batch 1, of 2..4 to 4; a step without drafts of 2 sequences with up to 8 blocks
    # runs in (2, 1, 8) or (2, 1, 16): batch 2; of 3 or 4 in (4, 1, 32). 8 rows hold no sequences.
    from serving.lint_buckets import drafter_block_batches, speculative_decode_buckets
    from serving.recipe import Geometry

    g = Geometry(block_size=128, max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=2048,
                 max_prefill_batch_size=1, sliding_window=0, max_decode_graphs=4)
    seeds = {(1, 1, 8), (4, 1, 32)}
    prepared = speculative_decode_buckets(seeds, 1, g)
    assert prepared == seeds | {(2, 1, 8), (2, 1, 16), (8, 1, 32), (8, 1, 64)}
    assert drafter_block_batches(seeds, prepared, g) == {1, 2, 4}
    # two sequences with 9 to 16 blocks: (2, 1, 16) holds them, so batch 2 stays the only new one;
    # without it they would run in (4, 1, 32)
    assert drafter_block_batches(seeds, prepared - {(2, 1, 16)}, g) == {1, 2, 4}
    assert drafter_block_batches(seeds, prepared - {(2, 1, 8), (2, 1, 16)}, g) == {1, 4}


# The variants' own bucket files ------------------------------------------------------------------

VARIANT_FILE = SERVING / VARIANT["buckets"]["file"]
DRAFTS = json.loads(VARIANT["serve"]["speculative-config"])["num_speculative_tokens"]
DFLASH2_FILE = SERVING / RECIPE["dflash2"]["buckets"]["file"]


def test_the_variants_bucket_file_regenerates_byte_for_byte(tmp_path, variant):
    from serving import make_buckets
    from serving.recipe import recipe_geometry

    path = SERVING / RECIPE[variant]["buckets"]["file"]
    assert len({path.name, RECIPE["buckets"]["file"], *(RECIPE[v]["buckets"]["file"] for v in METHODS)}) == 3
    text = path.read_text()
    k = json.loads(RECIPE[variant]["serve"]["speculative-config"])["num_speculative_tokens"]
    drafter_k = k if METHODS[variant] == "dflash" else 0
    assert text == make_buckets.render(recipe_geometry(RECIPE), path.name, variant, drafter_k=drafter_k)
    assert f"# Generated by `python -m serving.make_buckets --{variant}` from serving/recipe.yaml" in text
    assert make_buckets.main([f"--{variant}", "--check"]) == 0
    stale = tmp_path / path.name
    stale.write_text(text.replace("(16, 1, [512, ", "(16, 1, [1024, "))
    assert make_buckets.main([f"--{variant}", "--check", "--out", str(stale)]) == 1


def test_the_dflash2_file_keeps_the_prompt_buckets_and_fits_the_limit_with_the_drafter_graphs():
    from serving.lint_buckets import drafter_block_batches, lint_bucket_text, parse_bucket_text, speculative_decode_buckets
    from serving.recipe import recipe_geometry

    g = recipe_geometry(RECIPE)
    text = DFLASH2_FILE.read_text()
    ours, _ = parse_bucket_text(text)
    base, _ = parse_bucket_text((SERVING / RECIPE["buckets"]["file"]).read_text())
    assert {b.shape for b in ours if b.query != 1} == {b.shape for b in base if b.query != 1}
    seeds = {b.shape for b in ours if b.query == 1}
    # batch 1 keeps 4K, 64K and 256K a sequence; batch 4 4K and 64K; batch 16 4K and 256K
    assert seeds == {(1, 1, 32), (1, 1, 512), (1, 1, 2048), (4, 1, 128), (4, 1, 2048), (16, 1, 512), (16, 1, 32768)}
    prepared = speculative_decode_buckets(seeds, 7, g)
    assert len(prepared) == 21 and drafter_block_batches(seeds, prepared, g) == {1, 4, 8, 16}
    assert lint_bucket_text(text, g, 7, drafter_graphs=True) == []
    # the header says what it counts, and what it gives up against the speculative file
    assert ("# At k = 7: 21 decode graphs and 4 drafter block graphs (one per padded batch: 1, 4, 8, 16),\n"
            "# 25 captured graphs; the limit is 25") in text
    assert "drops batch 4's 256K and batch 16's 64K tiers" in text


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


def test_the_variant_serves_with_its_own_bucket_file_through_launch_sh(tmp_path, variant):
    section = RECIPE[variant]
    env = fake_vllm(tmp_path)
    run = subprocess.run([str(SERVING / section["script"]), "/models/beam"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    path = section["env"]["VLLM_BUCKETING_FROM_FILE"]
    assert served_env(tmp_path)["VLLM_BUCKETING_FROM_FILE"] == path
    assert path.endswith("/serving/" + section["buckets"]["file"])
    # the image path resolves in the repository layout (ports/beam-1-0/serving -> serving/)
    local = local_file(path)
    assert local.resolve() == (SERVING / section["buckets"]["file"]).resolve() and local.is_file()
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[-3:] == ["--no-async-scheduling", "--speculative-config", section["serve"]["speculative-config"]]
    # every other env value is the recipe's; launch.sh alone keeps the recipe's file
    assert {k: v for k, v in served_env(tmp_path).items() if k in RECIPE["env"]} == {
        **RECIPE["env"], **section["env"]}
    assert subprocess.run([str(SERVING / "launch.sh"), "/models/beam"], env=env).returncode == 0
    assert served_env(tmp_path)["VLLM_BUCKETING_FROM_FILE"] == RECIPE["env"]["VLLM_BUCKETING_FROM_FILE"]
