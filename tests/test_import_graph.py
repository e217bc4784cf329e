"""The house's arrows, from the code's own imports (every import, deferred ones too):
- no circle anywhere in `beam_hpu/`: a module never imports, through any chain, a module that
  imports it;
- no circle of rooms either (a room: a top-level folder or module, or one feature of the runtime
  wing): two rooms never reach each other, even through modules that form no circle;
- the reference job's rooms run down, gates -> reference -> quant -> loader -> model: none imports
  a room to its left, and none of the lower four imports the gate suite, the CLI, the demo's
  serving or the replica fleet."""

import textwrap

from tests.support.engines import REPO
from tests.support.import_graph import cycles, import_graph, room, room_graph

PACKAGE = REPO / "beam_hpu"
DOWNWARD = ["beam_hpu.gates", "beam_hpu.reference", "beam_hpu.quant", "beam_hpu.loader", "beam_hpu.model"]
TOP = ["beam_hpu.gates", "beam_hpu.cli", "beam_hpu.demo", "beam_hpu.replicas"]


def room_imports(graph) -> set[tuple[str, str, str]]:
    """(importing room, imported room, importing module) for each import that crosses rooms."""
    return {(room(a), room(b), a) for a, targets in graph.items() for b in targets if room(a) != room(b)}


def test_no_import_circle_in_the_package():
    assert cycles(import_graph(PACKAGE)) == []


def test_no_circle_of_rooms():
    assert cycles(room_graph(import_graph(PACKAGE))) == []


def test_the_reference_rooms_only_import_down():
    crossings = room_imports(import_graph(PACKAGE))
    upward = sorted((module, b) for a, b, module in crossings
                    if a in DOWNWARD and b in DOWNWARD and DOWNWARD.index(b) < DOWNWARD.index(a))
    assert upward == []
    climbs = sorted((module, b) for a, b, module in crossings if a in DOWNWARD[1:] and b in TOP)
    assert climbs == []


def test_the_finders_see_a_circle_and_a_climb(tmp_path):
    """The checks above can fail: a deferred import that closes a circle, and a relative one that
    climbs from the reference room to the gates."""
    pkg = tmp_path / "beam_hpu"
    for sub in ("gates", "reference"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "gates" / "perplexity.py").write_text("from beam_hpu.reference.live import x\n")
    (pkg / "reference" / "live.py").write_text(textwrap.dedent("""\
        def f():
            from ..gates import perplexity
        x = 1
    """))
    graph = import_graph(pkg)
    assert graph["beam_hpu.reference.live"] == {"beam_hpu.gates", "beam_hpu.gates.perplexity"}
    assert cycles(graph) == [["beam_hpu.gates.perplexity", "beam_hpu.reference.live"]]
    assert ("beam_hpu.reference", "beam_hpu.gates", "beam_hpu.reference.live") in room_imports(graph)


def test_the_room_check_sees_a_circle_no_module_check_sees(tmp_path):
    """Two rooms reaching each other through different modules: no module circle, a room circle;
    inside the runtime wing each feature is its own room."""
    pkg = tmp_path / "beam_hpu"
    for sub in ("tiny", "quant", "runtime", "runtime/fp8", "runtime/prefill"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "tiny" / "fp8.py").write_text("from beam_hpu.quant.quantiser import q\n")
    (pkg / "quant" / "quantiser.py").write_text("q = 1\n")
    (pkg / "quant" / "check.py").write_text("def f():\n    from beam_hpu.tiny import fp8\n")
    (pkg / "runtime" / "fp8" / "gather.py").write_text("from beam_hpu.runtime.prefill.tiles import t\n")
    (pkg / "runtime" / "prefill" / "tiles.py").write_text("t = 1\n")
    (pkg / "runtime" / "prefill" / "inflight.py").write_text("from beam_hpu.runtime.fp8 import gather\n")
    graph = import_graph(pkg)
    assert cycles(graph) == []
    assert cycles(room_graph(graph)) == [["beam_hpu.quant", "beam_hpu.tiny"],
                                         ["beam_hpu.runtime.fp8", "beam_hpu.runtime.prefill"]]

