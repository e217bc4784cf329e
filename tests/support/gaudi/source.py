"""Run single functions of a (patched) vllm-gaudi source file on CPU, without importing it.

Public vllm-gaudi main 091bbadd does not import against vLLM 0.30.0: it pins vLLM main 14617c2b of
2026-08-20, a month older than v0.30.0 (ced6857a), whose runner imports it no longer has. So the
vllm-gaudi fix tests take the functions a fix changes straight from the patched file: the
function's own source, compiled and run with the few globals it reads given by the test (torch,
numpy, stand-ins for Habana helpers). What runs is the file's code, patched or stock.
"""
from __future__ import annotations

import ast
import functools
import math
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import torch

RUNNER = "vllm_gaudi/v1/worker/hpu_model_runner.py"
PATCHES = "vllm_gaudi/patches.py"
RUNNER_CLS = "HPUModelRunner"
PROCESSOR_CLS = "HPUAttentionMetadataProcessor"


def find_def(tree: ast.Module, name: str, cls: str | None = None) -> ast.FunctionDef | None:
    body = tree.body
    if cls is not None:
        found = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
        body = found.body if found else []
    return next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def load(path: Path, name: str, cls: str | None = None, **globals_):
    """The function `name` (a method of `cls` if given) of the file at `path`, as a plain
    function bound to `globals_`, or None when the file has no such function."""
    code = _function_code(str(path), path.read_text(), name, cls)
    if code is None:
        return None
    namespace = dict(globals_, __builtins__=__builtins__)
    exec(code, namespace)
    return namespace[name]


@functools.lru_cache(maxsize=512)
def _function_code(path: str, text: str, name: str, cls: str | None):
    """The compiled definition of one function of a file, by the file's text: tests load the same
    functions thousands of times (one KV write per layer and step), and parsing the whole runner
    file each time was half of their run time."""
    node = find_def(ast.parse(text), name, cls)
    if node is None:
        return None
    node.decorator_list = []
    return compile(ast.fix_missing_locations(ast.Module(body=[node], type_ignores=[])), f"{path}:{name}", "exec")


def method_body_if(path: Path, method: str, cls: str, test: str) -> ast.If:
    """The `if <test>:` statement inside a method (e.g. an async branch of a long method)."""
    node = find_def(ast.parse(path.read_text()), method, cls)
    return next(n for n in ast.walk(node) if isinstance(n, ast.If) and ast.unparse(n.test) == test)


def run_block(node: ast.stmt, path: Path, **names) -> dict:
    """Execute one statement of the file with the given names; returns the names afterwards."""
    return run_statements([node], path, names)


def run_statements(nodes, path, namespace: dict) -> dict:
    """Execute statements taken from the file at `path` in `namespace` (the one place a slice of
    the tree runs here); returns the namespace, holding what they bound."""
    namespace.setdefault("__builtins__", __builtins__)
    module = ast.fix_missing_locations(ast.Module(body=list(nodes), type_ignores=[]))
    exec(compile(module, str(path), "exec"), namespace)
    return namespace


def exec_module(path: Path, module_name: str | None = None, **names) -> dict:
    """The module at `path`, executed with its `from vllm_gaudi... import` lines left out and
    `names` given instead; its namespace. With `module_name` it runs as a module registered in
    sys.modules under that name (dataclasses look their module up there)."""
    tree = ast.parse(path.read_text())
    body = [n for n in tree.body
            if not (isinstance(n, ast.ImportFrom) and (n.module or "").startswith("vllm_gaudi"))]
    if module_name is None:
        return run_statements(body, path, {"__name__": f"gaudi_tree_{path.stem}", **names})
    module = types.ModuleType(module_name)
    vars(module).update(names)
    sys.modules[module_name] = module
    return run_statements(body, path, vars(module))


def calls_in_order(path: Path, method: str, cls: str) -> list[str]:
    """The unparsed call targets inside a method, in source order."""
    node = find_def(ast.parse(path.read_text()), method, cls)
    calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
    return [ast.unparse(c.func) for c in sorted(calls, key=lambda c: (c.lineno, c.col_offset))]


class HostTorch:
    """torch without pinned memory (the runner asks for it; a CPU-only torch has none)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, pin_memory=False, **kwargs):
        return torch.tensor(*args, **kwargs)


def namespace_replace(record, _name, **fields):
    """custom_tuple_replace for metadata held as a namespace: a copy with `fields` replaced."""
    return SimpleNamespace(**{**vars(record), **fields})


def block_mapping(runner_path: Path):
    """The tree's HPUAttentionMetadataProcessor._set_block_mapping on its CPU branch (is_fake_hpu:
    one_hot of padding rows), over metadata held as a namespace."""
    return load(runner_path, "_set_block_mapping", PROCESSOR_CLS, torch=torch, math=math, is_fake_hpu=lambda: True,
                custom_tuple_replace=namespace_replace)
