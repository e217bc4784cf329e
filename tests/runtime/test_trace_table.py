"""The tree-trace table of beam_hpu/runtime/README.md without a tree: it is written as the generator
writes it, its card-check column names rows card-check has, and the comparison the tree tests make
(tests/support/gaudi/trace_table.py `differences`) names a row that differs. Whether the table is
what the runs reach is checked by the tree tests themselves (test_tree_beam_layers.py,
test_tree_dflash2_rope.py)."""
from __future__ import annotations

import re

import pytest

from tests.support.gaudi import trace_table


def records(reacher: str) -> list[dict]:
    """The trace records the committed table's rows reached by `reacher` stand for."""
    out = []
    for name, tree, stand_in, reached, _ in trace_table.committed_rows():
        if reacher not in reached.split(", "):
            continue
        path, function = re.fullmatch(r"`([^`]+)` `([^`]+)`", tree).groups()
        override = re.fullmatch(r"override `([^`]+)` \(vLLM's `([^`]+)`\)", name)
        if override:
            out.append({"kind": "override", "name": override[1], "tree": f"{path}:{function}",
                        "replaces": override[2]})
        else:
            op = re.fullmatch(r"Habana `([^`]+)`", name)[1]
            served = re.findall(r"(?:^|; )`([\w.]+)`, ", stand_in)
            out.append({"kind": "habana", "name": op, "tree": f"{path}:{function}", "stand_ins": served})
    return out


def test_the_table_is_written_as_the_generator_writes_it():
    text = trace_table.README.read_text()
    body = re.search(r"<!-- generated:tree-trace -->\n(.*?)<!-- end:tree-trace -->", text, re.S)[1]
    assert trace_table.render(trace_table.committed_rows()) == body
    for row in trace_table.committed_rows():
        reached = row[3].split(", ")
        assert reached == [r for r in trace_table.REACHERS if r in reached], row


def test_card_check_names_its_rows_and_says_no_for_the_rest():
    assert set(trace_table.CARD_CHECK.values()) <= trace_table.card_check_rows()
    assert trace_table.card_check("torch.ops.hpu.an_op_no_row_measures") == "no"


@pytest.mark.parametrize("reacher", trace_table.REACHERS)
def test_a_trace_matches_the_rows_it_stands_for_and_a_changed_one_is_named(reacher):
    trace = records(reacher)
    assert trace and trace_table.differences(trace, reacher) == []
    habana = next(r for r in trace if r["kind"] == "habana")
    changed = [dict(r, stand_ins=["cast_to_fp8_v2"]) if r is habana else r for r in trace]
    stale = trace_table.differences(changed, reacher)
    assert len(stale) == 1 and stale[0].startswith(f"differs: Habana `{habana['name']}`")
    assert "cast_to_fp8_v2" in stale[0]
    dropped = trace_table.differences(trace[1:], reacher)
    assert len(dropped) == 1 and dropped[0].startswith("only in the table: ")
