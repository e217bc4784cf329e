"""The fix profile and the port on the release proxy (tests/support/release_proxy.py): 091bbadd with
the v0.30.0 changelog's PRs a vllm-gaudi git directory holds. Every unit applies there but those
the changelog data names, each of which `--explain` traces to the PR that moved its anchor; and
the tree tests of every unit whose edited code differs between the two trees pass on the proxy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fixes.engine import run
from fixes.explain import explain
from fixes.profile import load_profile
from tests.support.engines import REPO
from tests.support.gaudi.tree import PORT_PROFILE, gaudi_units, patched_copy
from tests.support.release_proxy import (BUILD_PROBLEM, FIXES_PROFILE, MISSING, PORT_PROFILE as PROXY_PORT, WHOLE_PORT_PROFILE,
                                         edited_scopes, read_changelog, write_proxy_profiles)

pytestmark = pytest.mark.gaudi_tree

# The tree tests that exercise each unit of the fix profile and the port (their modules).
UNIT_TESTS = {
    "prompt-order": ["tests/fixes/test_fixes_gaudi_units.py"],
    "structured-output-rows": ["tests/fixes/test_fixes_gaudi.py"],
    "so-row-owners": ["tests/fixes/test_fixes_gaudi_units.py"],
    "async-inputs": ["tests/fixes/test_fixes_gaudi_units.py"],
    "resumed-prefill-logits": ["tests/fixes/test_fixes_gaudi_units.py"],
    "gather-logprobs-int32": ["tests/fixes/test_fixes_gaudi_units.py"],
    "prompt-logprobs": ["tests/fixes/test_fixes_gaudi_units.py"],
    "seeded-sampling": ["tests/fixes/test_fixes_gaudi_units.py"],
    "swa-decode-window": ["tests/fixes/test_fixes_gaudi_units.py", "tests/runtime/sliding_window/test_tree_window.py"],
    "moe-explicit-overload": ["tests/fixes/test_fixes_gaudi.py"],
    "beam-exact-window": ["tests/runtime/sliding_window/test_tree_window.py"],
    "beam-grammar-device-mask": ["tests/runtime/grammar/test_tree_device_mask.py"],
    "beam-fsdpa-tiles": ["tests/runtime/prefill/test_tree_fsdpa_tiles.py"],
    "beam-grammar-verify": ["tests/runtime/speculative/test_tree_grammar_verify.py"],
    "beam-eagle-draft-end": ["tests/runtime/speculative/test_tree_eagle_draft.py"],
    "beam-sampled-verify": ["tests/runtime/speculative/test_tree_sampled_verify.py"],
    "beam-exact-rounding": ["tests/runtime/fp8/test_tree_exact_rounding.py", "tests/reference/test_tree_kv_fp8.py"],
    "beam-moe-gather": ["tests/runtime/fp8/test_tree_moe_gather.py"],
    "beam-window-kv-cache": ["tests/runtime/window_kv/test_tree_cache.py",
                             "tests/runtime/window_kv/test_tree_cache_worker.py"],
    "beam-window-kv-steps": ["tests/runtime/window_kv/test_tree_steps.py"],
    "beam-window-kv-metadata": ["tests/runtime/window_kv/test_tree_forward.py"],
    "beam-dflash2-proposer": ["tests/runtime/speculative/test_tree_dflash2_proposer.py"],
}


@pytest.fixture(scope="module")
def proxy():
    if BUILD_PROBLEM:
        pytest.fail(BUILD_PROBLEM[0], pytrace=False)
    if not os.environ.get("GAUDI_PROXY_ROOT"):
        pytest.skip(MISSING)
    return Path(os.environ["GAUDI_PROXY_ROOT"])


@pytest.fixture(scope="module")
def profiles(proxy, tmp_path_factory):
    head = subprocess.run(["git", "-C", str(proxy), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    return write_proxy_profiles(head, tmp_path_factory.mktemp("proxy-profiles"))


def test_every_unit_names_its_tree_tests():
    units = {u.name for u in load_profile("port-beam-1-0").fixes if u.package == "vllm_gaudi" and u.edits}
    assert set(UNIT_TESTS) == units
    assert all((REPO / m).is_file() for modules in UNIT_TESTS.values() for m in modules)


def test_only_the_named_units_miss_on_the_proxy_and_explain_names_the_pr(proxy, profiles):
    whole = load_profile(WHOLE_PORT_PROFILE, profiles)
    report = run(whole, roots={"vllm_gaudi": str(proxy)}, checkouts={"vllm_gaudi": str(proxy)},
                 only=gaudi_units(whole), check=True)
    diverging = {pr.diverging_unit(): pr for pr in read_changelog().prs if pr.divergence}
    assert {r.fix for r in report.refused_edits} == set(diverging), report.lines
    names = [u.name for u in whole.fixes]
    for refused in report.refused_edits:
        pr = diverging[refused.fix]
        assert pr.divergence.startswith(f"{refused.fix} edit {refused.index}:")
        text = "\n".join(explain(refused, whole.fixes[:names.index(refused.fix)], str(proxy)).report())
        assert re.search(rf"last changed there by: \w+ release proxy: merge vllm-gaudi #{pr.number} ", text), text


def test_the_fix_profile_and_the_rest_of_the_port_apply_on_the_proxy(proxy, profiles, tmp_path):
    port = load_profile(PROXY_PORT, profiles)
    assert load_profile(FIXES_PROFILE, profiles).packages["vllm_gaudi"].commit == port.packages["vllm_gaudi"].commit
    patched_copy(proxy, tmp_path / "proxy", port)


def test_tree_tests_of_the_units_that_differ_pass_on_the_proxy(proxy, profiles, tmp_path):
    """Units whose edited functions are the same text on both trees run the same code; the others'
    tree tests run again, here, on the proxy (in a child pytest: they read the tree at import)."""
    port = load_profile(PROXY_PORT, profiles)
    stand_in = patched_copy(Path(os.environ["GAUDI_FIXES_ROOT"]), tmp_path / "stand-in",
                             load_profile(PORT_PROFILE))
    on_proxy = patched_copy(proxy, tmp_path / "proxy", port)
    differ = [u.name for u in port.fixes if u.package == "vllm_gaudi" and u.edits
              and edited_scopes(stand_in, u) != edited_scopes(on_proxy, u)]
    # What the release's PRs touch: the MoE op (#1666, #1731) and initialize_kv_cache (#1666)
    assert {"moe-explicit-overload", "beam-exact-rounding", "beam-window-kv-cache"} <= set(differ), differ
    modules = sorted({m for name in differ for m in UNIT_TESTS[name]})
    env = dict(os.environ, GAUDI_FIXES_ROOT=str(proxy), GAUDI_PROFILES_DIR=str(profiles),
               GAUDI_FIXES_PROFILE=FIXES_PROFILE, GAUDI_PORT_PROFILE=PROXY_PORT)
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *modules], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    tail = proc.stdout[-3000:]
    assert proc.returncode == 0, f"units {differ} on the proxy:\n{tail}\n{proc.stderr[-2000:]}"
    passed = re.search(r"(\d+) passed", tail)
    assert passed and int(passed.group(1)) > 0 and "skipped" not in tail.splitlines()[-1], tail
    print(f"on the release proxy, units {differ}: {tail.splitlines()[-1]}")
