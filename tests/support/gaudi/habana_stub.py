"""Stand-ins for the Habana modules, so vllm-gaudi's Python imports on a CPU host.

The same approach as vllm-gaudi's own CPU-capable unit tests: every habana_frameworks module is
one MagicMock, installed before anything imports vllm_gaudi. Only what the tests exercise is
real (torch on CPU, vLLM 0.30.0, the patched vllm-gaudi sources).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from unittest.mock import MagicMock

HABANA_MODULES = [
    "habana_frameworks",
    "habana_frameworks.torch",
    "habana_frameworks.torch.core",
    "habana_frameworks.torch.hpu",
    "habana_frameworks.torch.internal",
    "habana_frameworks.torch.internal.bridge_config",
    "habana_frameworks.torch.utils",
    "habana_frameworks.torch.utils.experimental",
    "habana_frameworks.torch.utils.internal",
]


def install() -> None:
    import torch

    stub = MagicMock()
    for name in HABANA_MODULES:
        sys.modules.setdefault(name, stub)
    if not hasattr(torch, "hpu"):
        torch.hpu = MagicMock()


@contextmanager
def installed():
    """The stand-ins for the duration of a block only (e.g. while a tree module is executed in
    this process): what the block added is taken out again, so a later test in the same worker
    does not find a fake habana_frameworks (beam_hpu's guards ask importlib.util.find_spec, which
    refuses a module without a spec)."""
    import torch

    before = {name: sys.modules.get(name) for name in HABANA_MODULES}
    had_hpu = hasattr(torch, "hpu")
    install()
    try:
        yield
    finally:
        for name, module in before.items():
            if module is None:
                sys.modules.pop(name, None)
        if not had_hpu:
            del torch.hpu
