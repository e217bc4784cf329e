"""The one way the port changes vLLM at run time: wrap a function where its class (or module)
defines it.

`wrap(owner, attr, make, patch=NAME)` replaces `owner.attr` by `make(original)`, marks the
wrapper with the patch's name and records the target in `APPLIED`. Idempotent per process: a
target already carrying the mark is left as it is, so `register()` may run any number of times
(vLLM calls it in every process, sometimes twice). A target that is not where the patch expects
it (vLLM moved or renamed it) is a `PatchError` naming the patch and the target: the port refuses
to start rather than serve without a patch it relies on.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

MARK = "__beam_hpu_patch__"
# target ("module.Class.attr") -> patch name, for every wrap this process has installed.
APPLIED: dict[str, str] = {}


class PatchError(RuntimeError):
    """A runtime patch cannot be installed; the message names the patch and its target."""


def target_name(owner, attr: str) -> str:
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}.{attr}"
    return f"{owner.__module__}.{owner.__qualname__}.{attr}"


def patch_of(function) -> str | None:
    """The name of the patch that wrapped `function` (a plain or static method), or None."""
    raw = function.__func__ if isinstance(function, staticmethod) else function
    return getattr(raw, MARK, None)


def wrap(owner, attr: str, make: Callable[[Callable], Callable], *, patch: str) -> bool:
    """Wrap `owner.attr` (a class or a module that defines it itself; a staticmethod stays one).
    True if installed now, False if this process had already installed it."""
    target = target_name(owner, attr)
    raw = owner.__dict__.get(attr)
    if raw is None:
        raise PatchError(f"runtime patch {patch}: {target} does not exist in this vLLM "
                         "(the patch index in beam_hpu/runtime/__init__.py names what it expects)")
    if patch_of(raw) == patch:
        APPLIED[target] = patch
        return False
    static = isinstance(raw, staticmethod)
    original = raw.__func__ if static else raw
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, MARK, patch)
    setattr(owner, attr, staticmethod(wrapper) if static else wrapper)
    APPLIED[target] = patch
    return True
