"""Run single functions of a (patched) vllm-gaudi source file on CPU, without importing it.

Public vllm-gaudi main does not import against vLLM 0.30.0 (it expects a newer vLLM), so the
vllm-gaudi fix tests take the functions a fix changes straight from the patched file: the
function's own source, compiled and run with the few globals it reads given by the test (torch,
numpy, stand-ins for Habana helpers). What runs is the file's code, patched or stock.
"""
from __future__ import annotations

import ast
from pathlib import Path

RUNNER = "vllm_gaudi/v1/worker/hpu_model_runner.py"
PATCHES = "vllm_gaudi/patches.py"


def find_def(tree: ast.Module, name: str, cls: str | None = None) -> ast.FunctionDef | None:
    body = tree.body
    if cls is not None:
        found = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
        body = found.body if found else []
    return next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def load(path: Path, name: str, cls: str | None = None, **globals_):
    """The function `name` (a method of `cls` if given) of the file at `path`, as a plain
    function bound to `globals_`, or None when the file has no such function."""
    tree = ast.parse(path.read_text())
    node = find_def(tree, name, cls)
    if node is None:
        return None
    node.decorator_list = []
    module = ast.Module(body=[node], type_ignores=[])
    namespace = {"__builtins__": __builtins__, **globals_}
    exec(compile(module, f"{path}:{name}", "exec"), namespace)
    return namespace[name]


def method_body_if(path: Path, method: str, cls: str, test: str) -> ast.If:
    """The `if <test>:` statement inside a method (e.g. an async branch of a long method)."""
    node = find_def(ast.parse(path.read_text()), method, cls)
    return next(n for n in ast.walk(node) if isinstance(n, ast.If) and ast.unparse(n.test) == test)


def run_block(node: ast.stmt, path: Path, **names) -> dict:
    """Execute one statement of the file with the given names; returns the names afterwards."""
    module = ast.Module(body=[node], type_ignores=[])
    namespace = {"__builtins__": __builtins__, **names}
    exec(compile(module, str(path), "exec"), namespace)
    return namespace


def calls_in_order(path: Path, method: str, cls: str) -> list[str]:
    """The unparsed call targets inside a method, in source order."""
    node = find_def(ast.parse(path.read_text()), method, cls)
    calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
    return [ast.unparse(c.func) for c in sorted(calls, key=lambda c: (c.lineno, c.col_offset))]
