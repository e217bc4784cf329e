"""The gate suite runs on the Gaudi node against any endpoint: no module of it imports the tiny
model's trainer (torch training code, seeded mixtures), only the tasks it shares with it."""

from tests.support.engines import REPO
from tests.support.import_graph import imported_names

TRAINER = "beam_hpu.tiny.train"


def imported_modules(path) -> set[str]:
    return imported_names(path, "beam_hpu.gates")


def test_no_gate_module_imports_the_trainer():
    offenders = {p.name: sorted(n for n in imported_modules(p) if n == TRAINER or n.startswith(TRAINER + "."))
                 for p in sorted((REPO / "beam_hpu" / "gates").glob("*.py"))}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_import_finder_sees_both_forms(tmp_path):
    sample = tmp_path / "s.py"
    sample.write_text("def f():\n    from beam_hpu.tiny.train import Tasks\nimport beam_hpu.tiny.train as t\n"
                      "from beam_hpu.tiny import train\n")
    assert {"beam_hpu.tiny.train", "beam_hpu.tiny.train.Tasks"} <= imported_modules(sample)
    sample.write_text("from beam_hpu.tiny import train\n")
    assert "beam_hpu.tiny.train" in imported_modules(sample)
