"""A temp copy of the vllm-gaudi tree named by GAUDI_FIXES_ROOT (tests/support/gaudi_tree.py finds
one; the given tree is never written) with a fix profile's vllm-gaudi units applied, and a fresh
interpreter to import the patched copy in.

Two profiles: the v0.30.0 fixes (GAUDI_FIXES_PROFILE, default the stand-in profile
v0.30.0-public-main) and the beam-1-0 port (GAUDI_PORT_PROFILE), whose units come after every
v0.30.0 fix. "v0.30.0 only" (or "stock" in a port test) is the tree with the v0.30.0 fixes and
none of the port's units: the image without the port.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from fixes.engine import EXIT_OK, run
from fixes.profile import PROFILES_DIR, load_profile
from tests.support.engines import REPO
from tests.support.gaudi.source import RUNNER

PROFILE = os.environ.get("GAUDI_FIXES_PROFILE", "v0.30.0-public-main")
PORT_PROFILE = os.environ.get("GAUDI_PORT_PROFILE", "port-beam-1-0-public-main")
# The release proxy's profiles are written per session outside the checkout (tests/support/release_proxy.py)
TREE_PROFILES_DIR = Path(os.environ.get("GAUDI_PROFILES_DIR") or PROFILES_DIR)
# The trained tiny Beam the FP8 tree tests quantise for (its config is what vLLM's ModelConfig reads)
TINY_BEAM = REPO / "beam_hpu" / "tiny" / "data" / "trained_tiny"
PORT_UNITS = ["beam-exact-window", "beam-grammar-device-mask", "beam-fsdpa-tiles", "beam-grammar-verify",
              "beam-eagle-draft-end", "beam-sampled-verify", "beam-exact-rounding", "beam-moe-gather",
              "beam-window-kv-cache", "beam-window-kv-steps", "beam-window-kv-metadata", "beam-dflash2-proposer"]


def gaudi_root() -> Path:
    """The tree the tests copy (read when a test runs: tests/conftest.py may set it from the cache)."""
    return Path(os.environ["GAUDI_FIXES_ROOT"])


def tree_profile(name: str = PROFILE):
    """A profile of the tree under test (the stand-in's by default, the proxy's under GAUDI_PROFILES_DIR)."""
    return load_profile(name, TREE_PROFILES_DIR)


def gaudi_units(profile) -> list[str]:
    """The profile's units that edit vllm-gaudi source."""
    return [u.name for u in profile.fixes if u.package == "vllm_gaudi" and u.edits]


def copy_tree(dst: Path) -> tuple[Path, dict[str, str]]:
    """(temp root holding a copy of vllm_gaudi/, the --checkout the commit is read from)."""
    src = gaudi_root()
    if not (src / "vllm_gaudi" / "__init__.py").is_file():
        pytest.fail(f"GAUDI_FIXES_ROOT={src} has no vllm_gaudi/ package")
    shutil.copytree(src / "vllm_gaudi", dst / "vllm_gaudi", ignore=shutil.ignore_patterns("__pycache__"))
    checkout = {"vllm_gaudi": str(src)} if (src / ".git").exists() else {}
    return dst, checkout


def apply_fixes(root: Path, checkouts: dict[str, str], stock: bool = False):
    """The v0.30.0 profile's vllm-gaudi fixes on the copy at `root` (none when `stock`)."""
    if stock:
        return None
    profile = tree_profile(PROFILE)
    return run(profile, roots={"vllm_gaudi": str(root)}, checkouts=checkouts, only=gaudi_units(profile))


def apply_port(root: Path, checkouts: dict[str, str], only=None, check=False):
    """The port profile's vllm-gaudi units (`only` those, default all) on the copy at `root`."""
    profile = tree_profile(PORT_PROFILE)
    return run(profile, roots={"vllm_gaudi": str(root)}, checkouts=checkouts,
               only=only or gaudi_units(profile), check=check)


def port_tree(dst: Path, port: bool = True, without: tuple[str, ...] = ()) -> SimpleNamespace:
    """A copy at `dst` with the port profile applied: every unit, or (port=False) the v0.30.0 ones
    only; less the units `without`. `.port` is True only for the whole port."""
    root, checkouts = copy_tree(dst)
    only = [n for n in gaudi_units(tree_profile(PORT_PROFILE))
            if (port or n not in PORT_UNITS) and n not in without]
    report = apply_port(root, checkouts, only=only)
    assert report.exit_code == EXIT_OK, report.lines
    return SimpleNamespace(root=root, port=port and not without, runner=root / RUNNER)


def proxy_port_tree(dst: Path) -> SimpleNamespace:
    """The release proxy (tests/support/release_proxy.py) copied to `dst` with its port profile
    applied (the port less the units its PRs break); skips, naming what is missing, without one."""
    from tests.support.release_proxy import BUILD_PROBLEM, MISSING, PORT_PROFILE as PROXY_PORT, write_proxy_profiles

    if BUILD_PROBLEM:
        pytest.fail(BUILD_PROBLEM[0], pytrace=False)
    if not os.environ.get("GAUDI_PROXY_ROOT"):
        pytest.skip(MISSING)
    proxy = Path(os.environ["GAUDI_PROXY_ROOT"])
    head = subprocess.run(["git", "-C", str(proxy), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    (dst / "profiles").mkdir(parents=True)
    profile = load_profile(PROXY_PORT, write_proxy_profiles(head, dst / "profiles"))
    root = patched_copy(proxy, dst / "site", profile)
    return SimpleNamespace(root=root, port=True, runner=root / RUNNER)


def patched_copy(src: Path, dst: Path, profile) -> Path:
    """`src`'s vllm_gaudi/ copied to `dst` with `profile`'s vllm-gaudi units applied (src the checkout)."""
    shutil.copytree(src / "vllm_gaudi", dst / "vllm_gaudi", ignore=shutil.ignore_patterns("__pycache__"))
    report = run(profile, roots={"vllm_gaudi": str(dst)}, checkouts={"vllm_gaudi": str(src)},
                 only=gaudi_units(profile))
    assert report.exit_code == EXIT_OK, report.lines
    return dst


def stock_and_port(dst: Path) -> tuple[Path, Path]:
    """The roots of two copies under `dst`: the v0.30.0 fixes only ("stock"), and the whole port."""
    return port_tree(dst / "stock", port=False).root, port_tree(dst / "port").root


def port_tree_fixture(scope: str = "function", params: tuple[str, str] = ("v0.30.0 only", "port")):
    """A module's `tree` fixture: the tree without the port's units (params[0]), then with them."""

    @pytest.fixture(scope=scope, params=list(params))
    def tree(request, tmp_path_factory):
        return port_tree(tmp_path_factory.mktemp("site"), port=request.param == params[1])

    return tree


def run_stubbed(root: Path, body: str, timeout: int = 300, **names) -> str:
    """Run `body` in a fresh interpreter on CPU: the tree copy at `root` first on sys.path, then this
    repo, the Habana modules stubbed (habana_stub.py), `names` given as globals. Returns the last
    line it prints (vLLM may log to stdout before it)."""
    stub = (f"import sys\nsys.path.insert(0, {str(root)!r})\n"
            "from tests.support.gaudi import habana_stub\nhabana_stub.install()\n")
    return run_fresh(stub + textwrap.dedent(body), timeout, **names)


def run_fresh(body: str, timeout: int = 300, **names) -> str:
    """Run `body` in a fresh interpreter on vLLM-CPU, this repo on sys.path, `names` given as globals:
    the side a tree run is compared with, in a process no earlier test has touched, as the tree's.
    Returns the last line it prints."""
    head = (f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
            + "".join(f"{name} = {value!r}\n" for name, value in names.items()))
    proc = subprocess.run([sys.executable, "-c", head + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, VLLM_TARGET_DEVICE="cpu", PYTHONPATH=str(REPO)),
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]
