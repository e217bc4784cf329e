"""card-check's graph probe (beam_hpu/cardcheck/graph_probe.py) on a worker that runs Beam as a node
does: built on the vllm-gaudi tree's layers, split into lazy graph pieces by the tree runner's own
`modify_model_layers` with the runner's `get_target_layer_suffix_list` for Beam's model type, at each
VLLM_CONFIG_HIDDEN_LAYERS card-check times. The bridge's event dispatcher and step marker are
tests/support/gaudi/habana_events.py's stand-ins, after the bridge's source. So this shows that the
tree's split finds Beam's decoder layers (a marker after every n-th, none in between) and that the
probe counts what the bridge publishes per execute_model call; on CPU engines the probe says it
read nothing (tests/cardcheck/test_card_check_cpu.py)."""
from __future__ import annotations

import pytest
import torch

from beam_hpu.cardcheck.graph_probe import summarise
from tests.support.gaudi.hpu_layers import add_platform_entry_point
from tests.support.gaudi.tree import port_tree, run_stubbed

pytestmark = pytest.mark.gaudi_tree

INTERVALS = [1, 2, 4, 52]  # the recipe's graph_split settings past the model's depth included

ON_THE_TREE = r'''
import torch
from pathlib import Path
from tests.support.gaudi.beam_layers import as_on_the_node
as_on_the_node()
from tests.support.gaudi import beam_layers as bl, habana_events
htorch = habana_events.install()
bl.bridge_vllm_gaps()
from tests.support.gaudi.source import RUNNER, load
from beam_hpu.cardcheck.graph_probe import GraphProbe
from beam_hpu.model.beam import BeamDecoderLayer

runner = Path(ROOT) / RUNNER
model, config = bl.build()
bl.without_attention_backend(model)
suffixes = load(runner, "get_target_layer_suffix_list")(config.model_config.hf_config.model_type)
layers = [m for m in model.modules() if isinstance(m, BeamDecoderLayer)]
ids = torch.arange(5, 21)
positions = torch.arange(16)


class Worker(GraphProbe):
    def execute_model(self, ids, positions):
        out = bl.logits(model, ids, positions, config)
        htorch.core.mark_step()  # the runner's own marker after the forward
        return out


out = {"layers": len(layers), "windows": {}}
for n in INTERVALS:
    for layer in layers:
        layer._forward_hooks.clear()
    load(runner, "modify_model_layers", htorch=htorch)(model, suffixes, n)
    worker = Worker()
    habana_events.MEMORY.update(allocated=0, peak=0)
    windows = []
    for memory in (3 << 20, 5 << 20):  # what the two windows end with: the first one's graphs keep 3 MiB
        assert worker.beam_probe_start()
        worker.execute_model(ids, positions)
        worker.execute_model(ids, positions)
        habana_events.MEMORY.update(allocated=memory, peak=memory + (1 << 20))
        windows.append(worker.beam_probe_read())
    out["windows"][n] = windows
torch.save(out, OUT)
print("done")
'''


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("graph-probe")
    tree = port_tree(tmp / "site")
    add_platform_entry_point(tree.root)
    run_stubbed(tree.root, ON_THE_TREE, timeout=600, ROOT=str(tree.root), OUT=str(tmp / "out.pt"),
                INTERVALS=INTERVALS)
    return torch.load(tmp / "out.pt")


@pytest.mark.parametrize("n", INTERVALS)
def test_the_probe_counts_the_pieces_the_trees_split_gives_beam(probed, n):
    layers = probed["layers"]
    assert layers >= 4
    first, second = probed["windows"][n]
    # a marker after every n-th decoder layer, and the runner's own after the forward
    pieces = layers // n + 1
    assert first["available"] and first["markers"] == [pieces, pieces] == second["markers"]
    for window in (first, second):
        assert all(0 < d <= c for d, c in zip(window["dispatch_ms"], window["call_ms"]))
    node = summarise([first], [second])
    assert node["graph_pieces"] == node["markers_per_step"] == pieces
    assert node["graph_memory_mib"] == 3.0 and node["peak_memory_mib"] == 6.0
    assert node["compilations"] == node["recompilations"] == 0  # the stand-in bridge compiles nothing


def test_a_worker_without_the_bridge_reads_nothing():
    from beam_hpu.cardcheck.graph_probe import GraphProbe

    worker = GraphProbe()
    assert worker.beam_probe_start() is False
    read = worker.beam_probe_read()
    assert read == {"available": False, "why": "no Habana bridge in this worker: not a card"}
    assert summarise([read], [read]) == {"available": False, "why": read["why"]}
