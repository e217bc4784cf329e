"""A tree test that stubs Habana in this process leaves no fake habana_frameworks behind: the
guards' find_spec would raise on it in whatever test the same worker runs next."""
import importlib.util
import sys

import pytest

from tests.support.gaudi import habana_stub
from tests.support.gaudi.tree import gaudi_root
from tests.support.gaudi.window_kv_cache import tree_defragmenter_class

pytestmark = pytest.mark.gaudi_tree


def test_defragmenter_class_leaves_no_habana_stub_behind():
    assert "habana_frameworks" not in sys.modules
    cls = tree_defragmenter_class(gaudi_root())
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
