"""What a tree child's forward reached of vllm-gaudi and of the Habana kernels, recorded as it ran.

Made in the child after hpu_layers.install() (and install_hpu_ops() where the run has one), before
the model is built: a CustomOp binds `forward_oot` when it is constructed, so only a method
wrapped on its class before then is seen when it runs. Two kinds of rows:

- an override: a vllm-gaudi function vLLM runs in place of its own, either a method of a
  vllm_gaudi class that a vLLM base class also defines (HPURMSNorm.forward_oot for vLLM's RMSNorm),
  or a vllm_gaudi function the tree assigned into a vLLM module or class (MoERunnerBase.forward);
- a Habana op: an entry point the tree calls (an attribute of the hpex stand-in modules hpu_layers
  builds, or a torch.ops.hpu name), the tree function that called it (the nearest frame in the
  tree copy) and the functions of habana_ops.py that ran inside it.

Every override candidate is wrapped, but a row is kept only for a call made inside `recording()`:
what the forward ran, not what the build touched.
"""
from __future__ import annotations

import functools
import sys
import types
from contextlib import contextmanager
from pathlib import Path

TREE_PACKAGE = "vllm_gaudi"
HPEX = "habana_frameworks.torch.hpex"
WRAPPED = "__beam_trace__"


def _is_vllm(module_name: str) -> bool:
    return module_name == "vllm" or module_name.startswith("vllm.")


def _is_tree(module_name: str) -> bool:
    return module_name == TREE_PACKAGE or module_name.startswith(TREE_PACKAGE + ".")


def _function(attr):
    """(plain function, how to put a replacement back as the same kind of attribute) or None."""
    if isinstance(attr, staticmethod):
        return attr.__func__, staticmethod
    if isinstance(attr, classmethod):
        return attr.__func__, classmethod
    if isinstance(attr, types.FunctionType):
        return attr, lambda f: f
    return None


class Trace:
    """Made once per tree child; `recording()` around the forward, `records()` saved with its outputs."""

    def __init__(self):
        from tests.support.gaudi import habana_attention, habana_ops

        self.habana_ops = habana_ops
        # The modules whose classes stand in for hpex kernels (habana_attention: FusedSDPA)
        self.stand_in_modules = {habana_ops.__name__, habana_attention.__name__}
        import vllm_gaudi

        # The folder holding vllm_gaudi/: tree paths are given relative to it.
        self.root = str(Path(vllm_gaudi.__file__).resolve().parent.parent) + "/"
        self.active = False
        self.rows: set[tuple] = set()
        self._entries: list[list[str]] = []
        self._wrap_stand_ins()
        self.wrap_hpex()
        self._wrap_hpu_ops()
        self.scan()

    # -- recording --------------------------------------------------------------------------------

    @contextmanager
    def recording(self):
        """Rows are kept for calls inside this block; patches the tree made since the trace was
        made (a platform hook, a lazy import) are wrapped first."""
        self.scan()
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def records(self) -> list[dict]:
        """The rows as plain data (saved with a tree run's outputs)."""
        out = []
        for row in sorted(self.rows):
            kind, name, tree, extra = row
            key = "replaces" if kind == "override" else "stand_ins"
            out.append({"kind": kind, "name": name, "tree": tree, key: list(extra) if kind == "habana" else extra})
        return out

    def _tree_caller(self) -> str:
        """The innermost frame below the wrapper whose code lives in the tree copy."""
        frame = sys._getframe(2)
        while frame is not None:
            filename = frame.f_code.co_filename
            if filename.startswith(self.root):
                return f"{filename[len(self.root):]}:{frame.f_code.co_qualname}"
            frame = frame.f_back
        return "(not called from the tree)"

    # -- Habana side ------------------------------------------------------------------------------

    def _entry(self, name: str, inner):
        """`inner` as the Habana entry point `name`: a call records the tree function that made it
        and the habana_ops functions that ran under it."""
        trace = self

        @functools.wraps(inner)
        def entry(*args, **kwargs):
            if not trace.active:
                return inner(*args, **kwargs)
            caller = trace._tree_caller()
            served = [inner.__qualname__] if getattr(inner, "__module__", None) in trace.stand_in_modules else []
            trace._entries.append(served)
            try:
                return inner(*args, **kwargs)
            finally:
                trace._entries.pop()
                trace.rows.add(("habana", name, caller, tuple(sorted(set(served)))))

        setattr(entry, WRAPPED, True)
        return entry

    def _wrap_stand_ins(self):
        """Every public function of habana_ops.py, in its module: a stand-in that runs under an entry
        point (called by name from hpu_layers' op table, or from another stand-in) is named on it."""
        trace, module = self, self.habana_ops
        for name, attr in list(vars(module).items()):
            if name.startswith("_") or not isinstance(attr, types.FunctionType) or attr.__module__ != module.__name__:
                continue
            if getattr(attr, WRAPPED, False):
                continue

            def stand_in(*args, _inner=attr, **kwargs):
                if trace._entries:
                    trace._entries[-1].append(_inner.__qualname__)
                return _inner(*args, **kwargs)

            functools.update_wrapper(stand_in, attr)
            setattr(stand_in, WRAPPED, True)
            setattr(module, name, stand_in)

    def wrap_hpex(self):
        """The hpex stand-in modules' functions and the public methods of their classes, where the
        tree looks them up (it imports them when a forward first needs them; a kernel put there
        after the trace was made is wrapped by calling this again, before the tree loads it)."""
        for module_name, module in list(sys.modules.items()):
            if not module_name.startswith(HPEX) or not isinstance(module, types.ModuleType):
                continue
            for name, attr in list(vars(module).items()):
                if name.startswith("_") or getattr(attr, WRAPPED, False):
                    continue
                if isinstance(attr, types.FunctionType):
                    setattr(module, name, self._entry(f"{module_name}.{name}", attr))
                elif isinstance(attr, type) and attr.__module__ in self.stand_in_modules:
                    methods = {m: self._entry(f"{module_name}.{name}.{m}", f.__func__)
                               for m, f in vars(attr).items()
                               if not m.startswith("_") and isinstance(f, staticmethod)}
                    for m, f in vars(attr).items():
                        if not m.startswith("_") and isinstance(f, (classmethod, types.FunctionType)):
                            raise NotImplementedError(f"trace: {name}.{m} is no staticmethod; wrap it too")
                    if methods:
                        # A subclass in the module, so habana_ops' own class stays as written.
                        wrapped = type(name, (attr,), {m: staticmethod(f) for m, f in methods.items()})
                        wrapped.__module__, wrapped.__qualname__ = attr.__module__, attr.__qualname__
                        setattr(wrapped, WRAPPED, True)
                        setattr(module, name, wrapped)

    def _wrap_hpu_ops(self):
        """torch.ops.hpu's stand-in table when the run installed one (hpu_layers.install_hpu_ops)."""
        import torch

        from tests.support.gaudi.hpu_layers import HpuOps

        ops = getattr(torch.ops, "hpu", None)
        if not isinstance(ops, HpuOps):
            return
        for name, op in list(ops._ops.items()):
            if not getattr(op, WRAPPED, False):
                ops._ops[name] = self._entry(f"torch.ops.hpu.{name}", op)

    # -- vllm-gaudi side --------------------------------------------------------------------------

    def _override(self, kind_of, function, name: str, replaces: str):
        trace = self
        tree = f"{function.__code__.co_filename[len(self.root):]}:{function.__qualname__}"

        @functools.wraps(function)
        def override(*args, **kwargs):
            if trace.active:
                trace.rows.add(("override", name, tree, replaces))
            return function(*args, **kwargs)

        setattr(override, WRAPPED, True)
        return kind_of(override)

    def scan(self):
        """Wrap every override candidate not wrapped yet."""
        for module_name, module in list(sys.modules.items()):
            if not isinstance(module, types.ModuleType):
                continue
            if _is_tree(module_name):
                for cls in list(vars(module).values()):
                    if isinstance(cls, type) and cls.__module__ == module_name:
                        self._scan_tree_class(cls)
            elif _is_vllm(module_name):
                self._scan_vllm_namespace(module_name, module)

    def _scan_tree_class(self, cls: type):
        bases = [b for b in cls.__mro__[1:] if _is_vllm(b.__module__)]
        if not bases:
            return
        for name, attr in list(vars(cls).items()):
            if name.startswith("__") or getattr(attr, WRAPPED, False):
                continue
            found = _function(attr)
            if found is None or not found[0].__code__.co_filename.startswith(self.root):
                continue
            if not any(name in vars(b) for b in bases):
                continue
            replaces = f"{bases[0].__module__}.{bases[0].__qualname__}"
            setattr(cls, name, self._override(found[1], found[0], f"{cls.__qualname__}.{name}", replaces))

    def _scan_vllm_namespace(self, module_name: str, module):
        """The tree's functions assigned into a vLLM module, or into a class defined there."""
        def patch(owner, attr_name: str, qualname: str):
            attr = vars(owner).get(attr_name)
            found = _function(attr)
            if found is None or getattr(found[0], WRAPPED, False) or not _is_tree(found[0].__module__ or ""):
                return
            setattr(owner, attr_name, self._override(found[1], found[0], qualname, f"{module_name}.{qualname}"))

        for name, attr in list(vars(module).items()):
            if isinstance(attr, type) and attr.__module__ == module_name:
                for method in list(vars(attr)):
                    patch(attr, method, f"{attr.__qualname__}.{method}")
            else:
                patch(module, name, name)
