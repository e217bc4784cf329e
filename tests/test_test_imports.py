"""No test module imports another test module (a test_*.py or a conftest.py): what tests share lives
in tests/support/ (or a room's helper module), so a test file can be moved, renamed or run alone
without taking another file's tests and fixtures along."""

from tests.support.engines import REPO
from tests.support.import_graph import imports_of_test_modules

# Files another change is reworking (the served accuracy suite); their imports go with it.
EXEMPT = {
    ("tests/quant/test_fp8_served_accuracy.py", "tests.reference.test_in_memory"),
    ("tests/quant/test_rounding_served.py", "tests.quant.test_fp8_served_accuracy"),
}


def test_no_test_module_imports_another():
    assert sorted(set(imports_of_test_modules(REPO / "tests")) - EXEMPT) == []


def test_the_checker_sees_bare_relative_and_dotted_imports(tmp_path):
    files = {
        "tests/__init__.py": "",
        "tests/a/__init__.py": "",
        "tests/a/test_b.py": "X = 1\n",
        "tests/a/conftest.py": "K = 2\n",
        "tests/a/test_bare.py": "from test_b import X\n",
        "tests/a/test_relative.py": "from .test_b import X\n",
        "tests/a/test_conftest.py": "from .conftest import K\n",
        "tests/e/test_dotted.py": "def f():\n    import tests.a.test_b\n",
        "tests/e/test_clean.py": "import pytest\nfrom tests.support.helpers import X\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert imports_of_test_modules(tmp_path / "tests") == [
        ("tests/a/test_bare.py", "test_b"),
        ("tests/a/test_conftest.py", "tests.a.conftest"),
        ("tests/a/test_relative.py", "tests.a.test_b"),
        ("tests/e/test_dotted.py", "tests.a.test_b"),
    ]
