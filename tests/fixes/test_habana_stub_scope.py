"""A tree test that stubs Habana in this process leaves no fake habana_frameworks behind: the
guards' find_spec would raise on it in whatever test the same worker runs next."""
import importlib.util
import sys

import habana_stub

from test_window_kv_defrag import ROOT_ENV, tree_defragmenter_class  # noqa: F401
from test_fixes_gaudi import pytestmark  # noqa: F401  (skip without GAUDI_FIXES_ROOT)


def test_defragmenter_class_leaves_no_habana_stub_behind():
    from pathlib import Path

    assert "habana_frameworks" not in sys.modules
    cls = tree_defragmenter_class(Path(ROOT_ENV))
    assert cls.__name__ == "OnlineDefragmenter"
    assert "habana_frameworks" not in sys.modules
    assert importlib.util.find_spec("habana_frameworks") is None


def test_installed_restores_what_was_there():
    sentinel = object()
    sys.modules["habana_frameworks.torch.core"] = sentinel
    try:
        with habana_stub.installed():
            assert sys.modules["habana_frameworks"] is not None
        assert "habana_frameworks" not in sys.modules
        assert sys.modules["habana_frameworks.torch.core"] is sentinel
    finally:
        sys.modules.pop("habana_frameworks.torch.core", None)
