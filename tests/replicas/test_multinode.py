"""serving/multinode.md shows the router command `beam_hpu.replicas.multinode` generates, and that
command uses only flags the installed `vllm-router` lists."""

import re

from beam_hpu.replicas.multinode import main, node_router_command
from tests.support.router import router_help
from tests.support.engines import REPO


def doc_block(marker: str) -> str:
    text = (REPO / "serving" / "multinode.md").read_text()
    block = text[text.index(marker):]
    return block[block.index("```"):].split("\n", 1)[1].split("```", 1)[0]


def test_the_doc_shows_the_generated_router_command(capsys):
    main(["http://node1:8000", "http://node2:8000"])
    assert doc_block("<!-- router-command -->") == capsys.readouterr().out


def test_node_router_flags_are_vllm_routers():
    listed = set(re.findall(r"--[a-z][a-z0-9-]+", router_help()))
    used = {a for a in node_router_command(["http://n1:8000", "http://n2:8000"]) if a.startswith("--")}
    assert used <= listed, used - listed


def test_the_doc_points_to_files_that_exist():
    text = (REPO / "serving" / "multinode.md").read_text()
    for path in set(re.findall(r"`((?:serving|beam_hpu|tests|benchmarks)/[\w/.]+\.(?:py|sh|yaml|md))", text)):
        assert (REPO / path).exists(), path
