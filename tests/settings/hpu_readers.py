"""Which switches code that runs on HPU reads: the port's vllm-gaudi edits and the plugin code
vLLM runs there, followed function by function through beam_hpu.

A reader is a call `current(NAME, ...)` / `read_switch(NAME, ...)` (tests/settings/test_readers.py).
On HPU the code that runs is reached from these roots:
- every edit of a port unit (the port profile's units, in the rooms of beam_hpu/runtime/): the names it reads itself, and the
  beam_hpu functions it imports (`from beam_hpu.x import f`);
- every runtime patch the plugin installs on HPU (platform "any" or "hpu"): its whole module;
- what vLLM's registries import from the plugin on every platform: the parser classes, the model
  class and the `--load-format beam` loader.
From a root, a function or class reaches the module-level functions and classes it names, in its
own module or imported from beam_hpu. Never followed: beam_hpu/settings (the switch table and
the guards validate every switch), and the CPU-only modules (`cpu_*.py`, the portable FP8
experts): the runtime patch portable-fp8-moe is installed on every platform, but its method is chosen only where vLLM finds no
FP8 MoE backend, which on HPU it never asks (vllm-gaudi's own method is taken first).
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path

from beam_hpu import names
from beam_hpu.runtime import INDEX
from beam_hpu.parsers import REASONING_PARSER, TOOL_PARSER
from beam_hpu.settings.switches import SWITCHES

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "beam_hpu"
READER_FUNCTIONS = {"current", "read_switch"}
NOT_FOLLOWED = ("beam_hpu.settings",)
CPU_PORTABLE = "beam_hpu.runtime.fp8.portable_moe"
HPU_PLATFORMS = ("any", "hpu")
IMPORT_IN_EDIT = re.compile(r"from (beam_hpu(?:\.\w+)+) import \(?([\w, ]+)\)?")

Node = tuple[str, str]  # (module, top-level name)


def names_read_by_calls(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if called in READER_FUNCTIONS and isinstance(node.args[0].value, str):
            found.add(node.args[0].value)
    return found


def names_read_in_text(text: str) -> set[str]:
    # An edit is a fragment of a method, not always parseable alone.
    return {name for name in SWITCHES if any(f'{fn}("{name}"' in text for fn in READER_FUNCTIONS)}


def module_of(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


class Package:
    """beam_hpu's modules: their top-level functions and classes, and the names those import."""

    def __init__(self) -> None:
        self.defs: dict[Node, ast.AST] = {}
        self.modules: dict[str, ast.Module] = {}
        for path in sorted(PACKAGE.rglob("*.py")):
            module = module_of(path)
            tree = ast.parse(path.read_text())
            self.modules[module] = tree
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    self.defs[(module, node.name)] = node

    def _aliases(self, module: str, scope: ast.AST) -> dict[str, str]:
        """Local name -> the beam_hpu module or "module:name" it was imported as."""
        out = {}
        for tree in (self.modules[module], scope):
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("beam_hpu"):
                    for alias in node.names:
                        sub = f"{node.module}.{alias.name}"
                        out[alias.asname or alias.name] = sub if sub in self.modules else f"{node.module}:{alias.name}"
        return out

    def named_by(self, node: Node) -> set[Node]:
        module, _ = node
        scope = self.defs[node]
        aliases = self._aliases(module, scope)
        out = set()
        for sub in ast.walk(scope):
            if isinstance(sub, ast.Name):
                if (module, sub.id) in self.defs:
                    out.add((module, sub.id))
                elif ":" in aliases.get(sub.id, ""):
                    out.add(tuple(aliases[sub.id].split(":")))
            elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
                target = aliases.get(sub.value.id, "")
                if target in self.modules:
                    out.add((target, sub.attr))
            elif isinstance(sub, ast.ImportFrom) and (sub.module or "").startswith("beam_hpu"):
                out |= {(sub.module, a.name) for a in sub.names}  # imported in the body to be used there
        return {n for n in out if n in self.defs and followed(n[0])}

    def reached_from(self, roots: Iterable[Node]) -> set[Node]:
        seen, todo = set(), [n for n in roots if n in self.defs and followed(n[0])]
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(self.named_by(node) - seen)
        return seen


def followed(module: str) -> bool:
    leaf = module.rpartition(".")[2]
    return not (module.startswith(NOT_FOLLOWED) or leaf.startswith("cpu_") or module == CPU_PORTABLE)


def port_units() -> list[Path]:
    return sorted(PACKAGE.joinpath("runtime").rglob("beam-*.toml"))


def hpu_readers(units: Iterable[Path] | None = None) -> dict[str, list[str]]:
    """Switch -> where code that runs on HPU reads it (a port unit, or module:function)."""
    package = Package()
    readers: dict[str, list[str]] = {}
    roots: set[Node] = set()
    for unit in port_units() if units is None else units:
        for edit in tomllib.loads(unit.read_text()).get("edits", []):
            for name in names_read_in_text(edit["replacement"]):
                readers.setdefault(name, []).append(str(unit.relative_to(REPO)))
            for module, imported in IMPORT_IN_EDIT.findall(edit["replacement"]):
                roots |= {(module, n.strip()) for n in imported.split(",") if n.strip()}
    for patch in INDEX:
        if patch.platform in HPU_PLATFORMS:
            module = f"beam_hpu.runtime.{patch.module}"
            roots |= {node for node in package.defs if node[0] == module}
    model_module, model_class = names.MODEL_CLASS.split(":")
    roots |= {REASONING_PARSER, TOOL_PARSER, (model_module, model_class), ("beam_hpu.loader", "register")}
    for node in sorted(package.reached_from(roots)):
        for name in names_read_by_calls(package.defs[node]):
            readers.setdefault(name, []).append(":".join(node))
    return readers
