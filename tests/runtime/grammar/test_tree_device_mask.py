"""The port's grammar device mask (beam-grammar-device-mask) on the vllm-gaudi tree named by
GAUDI_FIXES_ROOT, on CPU, with and without the port: the tree's own apply_grammar_bitmask run from
the file (tests/support/gaudi/source.py); what is checked is the logits the mask leaves."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.support.gaudi.source import RUNNER_CLS, HostTorch, load
from tests.support.gaudi.tree import port_tree_fixture

pytestmark = pytest.mark.gaudi_tree
tree = port_tree_fixture()


# ---------------------------------------------------------------- grammar mask on the device

def masked_logits(tree, monkeypatch, switch, rows, grammar, model_type="beam"):
    import xgrammar

    calls = []

    def cpu_kernel(logits, bitmask, indices=None):
        calls.append("cpu")
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=indices)

    monkeypatch.setenv("BEAM_GRAMMAR_DEVICE_MASK", switch)
    apply_mask = load(tree.runner, "apply_grammar_bitmask", RUNNER_CLS, np=np, torch=HostTorch(),
                      xgr_cpu=SimpleNamespace(apply_token_bitmask_inplace_cpu=cpu_kernel))
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(rows)}),
                             device="cpu", _get_model_type=lambda: model_type)
    vocab = 70
    words = math.ceil(vocab / 32)
    bitmask = np.zeros((len(grammar), words), dtype=np.int32)
    for i, allowed in enumerate(grammar.values()):
        for tok in allowed:
            bitmask[i, tok // 32] |= np.int32(np.uint32(1 << (tok % 32)).view(np.int32))
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    grammar_output = SimpleNamespace(grammar_bitmask=bitmask, structured_output_request_ids=list(grammar))
    apply_mask(runner, SimpleNamespace(scheduled_spec_decode_tokens={}), grammar_output, logits, list(rows))
    return logits, calls


@pytest.mark.parametrize("grammar", [{"b": [0, 31, 32, 63, 69]}, {"a": [5], "b": [1, 2], "c": [64, 31]}])
def test_grammar_mask_on_the_device_matches_the_cpu_round_trip(tree, monkeypatch, grammar):
    rows = ["a", "b", "c"]
    device, device_calls = masked_logits(tree, monkeypatch, "1", rows, grammar)
    host, host_calls = masked_logits(tree, monkeypatch, "0", rows, grammar)
    assert host_calls == ["cpu"]
    assert device_calls == ([] if tree.port else ["cpu"])  # the port never round-trips with the switch on
    assert torch.equal(device, host)
    for r, req in enumerate(rows):
        allowed = set(grammar.get(req, range(70)))
        assert {t for t in range(70) if device[r, t] != float("-inf")} == allowed


def test_grammar_mask_stays_stock_for_another_model(tree, monkeypatch):
    """The plugin's image may serve other models: with the switch on, a llama's mask still takes
    vllm-gaudi's CPU round trip (the port acts for model type beam only)."""
    rows, grammar = ["a", "b", "c"], {"a": [5], "b": [1, 2], "c": [64, 31]}
    other, other_calls = masked_logits(tree, monkeypatch, "1", rows, grammar, model_type="llama")
    beam, _ = masked_logits(tree, monkeypatch, "1", rows, grammar)
    assert other_calls == ["cpu"]
    assert torch.equal(other, beam)
