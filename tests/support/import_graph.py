"""The import graph of a package, read from its source (nothing is imported): one node per module,
an edge for every import of another module of the package, at module level or inside a function
(a deferred import still makes the module depend on the other at run time)."""

from __future__ import annotations

import ast
from pathlib import Path


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `package_dir` (a package: `x/__init__.py` is `x`)."""
    root = package_dir.parent
    out = {}
    for f in sorted(package_dir.rglob("*.py")):
        parts = f.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imported_names(path: Path, package: str) -> set[str]:
    """Every dotted name `path` imports, `from a import b` giving both `a` and `a.b`; relative
    imports resolved against `package` (the module's own package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}
    return names


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a name is taken as its longest module prefix)."""
    files = module_files(package_dir)
    graph = {}
    for name, f in files.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for target in imported_names(f, package):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one node (each a set of modules that
    import each other round a circle), sorted; Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def room(module: str, depth: int = 2) -> str:
    """`beam_hpu.reference.streamed` -> `beam_hpu.reference`; a top-level module is its own room."""
    return ".".join(module.split(".")[:depth])


WINGS = ("runtime",)  # folders whose sub-folders are the rooms (one per runtime feature)


def feature_room(module: str) -> str:
    """The room a module lives in: its top-level folder, or inside a wing its feature's folder
    (`beam_hpu.runtime.fp8.portable_moe` -> `beam_hpu.runtime.fp8`); the wing's own index is a room."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in WINGS:
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def room_graph(graph: dict[str, set[str]], room_of=feature_room) -> dict[str, set[str]]:
    """Room -> the other rooms its modules import, from a module graph."""
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        here = room_of(module)
        rooms.setdefault(here, set()).update(room_of(t) for t in targets if room_of(t) != here)
    return rooms


def is_test_module(name: str) -> bool:
    """A module pytest collects or loads as a conftest: `test_*` or `conftest`, by its last part."""
    last = name.rpartition(".")[2]
    return last.startswith("test_") or last == "conftest"


def imports_of_test_modules(tests_dir: Path) -> list[tuple[str, str]]:
    """(file under tests_dir's parent, test module it imports) for every import of a test module or
    conftest by any module under `tests_dir`: bare (`from test_x import y`, what pytest's rootdir
    sys.path makes work), relative (`from .test_x import y`) or dotted (`import tests.a.test_b`,
    `from tests.a import test_b`; a function named test_* imported from anywhere counts too: pytest
    would collect it again in the importing module)."""
    root = tests_dir.parent
    found = []
    for f in sorted(tests_dir.rglob("*.py")):
        package = ".".join(f.parent.relative_to(root).parts)
        for name in sorted(imported_names(f, package)):
            if is_test_module(name):
                found.append((str(f.relative_to(root)), name))
    return found
