"""The port's Dockerfile only copies the repository and calls install.sh: nothing in it can drift
from what install.sh does (and tests) outside Docker."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "ports/beam-1-0/Dockerfile"
COOKBOOK = "/opt/gaudi-cookbook"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: comments dropped, continuations joined."""
    out, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "a continuation runs past the end of the file"
    return out


def run_argv(args: str) -> list[str]:
    return json.loads(args) if args.startswith("[") else ["/bin/sh", "-c", args]


def test_dockerfile_copies_the_repo_and_calls_only_install_sh():
    steps = instructions(DOCKERFILE)
    kinds = [k for k, _ in steps]
    assert kinds == ["ARG", "FROM", "COPY", "ENV", "RUN"], steps
    assert steps[0][1] == "BASE"  # no default: the stock v0.30.0 image must be named
    assert steps[1][1] in ("${BASE}", "$BASE")
    assert steps[2][1].split() == [".", COOKBOOK]
    assert steps[3][1] in (f"COOKBOOK={COOKBOOK}", f"COOKBOOK {COOKBOOK}")
    argv = run_argv(steps[4][1])
    assert argv in (["/bin/bash", f"{COOKBOOK}/ports/beam-1-0/install.sh"], [f"{COOKBOOK}/ports/beam-1-0/install.sh"])


def test_top_level_dockerfile_is_the_same_file():
    # The recipe builds with -f ports/beam-1-0/Dockerfile; `docker build .` finds the top-level one.
    # Two real files, not a symlink: BuildKit does not reliably follow a symlinked Dockerfile.
    assert (REPO / "Dockerfile").read_bytes() == DOCKERFILE.read_bytes()


def test_install_sh_is_executable_bash_and_strict():
    script = REPO / "ports/beam-1-0/install.sh"
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    assert script.stat().st_mode & 0o111


def test_recipe_bucket_path_exists_in_the_repository_layout():
    """The recipe's VLLM_BUCKETING_FROM_FILE is $COOKBOOK/ports/beam-1-0/serving/<file>: the
    repository carries ports/beam-1-0/serving as a relative symlink to serving/, which COPY keeps
    and which resolves inside /opt/gaudi-cookbook."""
    from serving.recipe import load_recipe

    recipe = load_recipe()
    path = recipe["env"]["VLLM_BUCKETING_FROM_FILE"]
    assert path.startswith(COOKBOOK + "/")
    local = REPO / path[len(COOKBOOK) + 1:]
    link = REPO / "ports/beam-1-0/serving"
    assert link.is_symlink() and not Path(link.readlink()).is_absolute()
    assert local.resolve() == (REPO / "serving" / recipe["buckets"]["file"]).resolve()
    assert local.is_file()


def test_dockerignore_keeps_what_install_sh_needs():
    ignored = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    for needed in ("fixes", "ports", "serving", "tests", "beam_hpu", "pyproject.toml"):
        assert not any(shlex.split(p)[0].strip("*/") == needed for p in ignored), needed
