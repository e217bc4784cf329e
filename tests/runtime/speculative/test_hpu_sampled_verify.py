"""The plain functions of the Gaudi verify step with sampled rows (beam_hpu.runtime.speculative.hpu_sampled_verify):
the padded layout's index of drafts, the drafts' target processing, and which requests it refuses.
The step itself runs on the vllm-gaudi tree in tests/runtime/speculative/test_tree_sampled_verify.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from beam_hpu.runtime.speculative import hpu_sampled_verify as sv
from beam_hpu.runtime.speculative.rejection_sampling import padded_index


def test_padded_index_points_each_slot_at_its_flattened_draft():
    # width 3: sequence 0 has 3 drafts, 1 has 1, 2 none, 3 has 2; padding slots read position 0
    assert padded_index([3, 1, 0, 2], 3).tolist() == [0, 1, 2, 3, 0, 0, 0, 0, 0, 4, 5, 0]
    assert padded_index([0, 0], 2).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="more drafts \\(4\\) than the verify step's 3 slots"):
        padded_index([4], 3)


def test_greedy_rows_are_vllm_gaudis_negative_temperature_and_zero():
    assert sv.greedy_rows(torch.tensor([-1.0, 0.0, 1e-6, 0.7])).tolist() == [True, True, True, False]


def test_constrain_targets_divides_each_request_and_keeps_greedy_rows():
    """Padded layout, width 2: request 0 greedy (-1.0), request 1 at T=0.5 with top_k 2."""
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, -1.0, 2.0], [1.0, 3.0, 2.0], [0.0, 1.0, 4.0]])
    out = sv.constrain_targets(logits.clone(), 2, torch.tensor([-1.0, 0.5]), torch.tensor([3, 2]), None)
    assert torch.equal(out[:2], logits[:2])  # greedy: divided by 1 (not by -1), top_k = vocab
    assert out[2, 0] == float("-inf") and out[2, 1:].tolist() == [6.0, 4.0]
    assert out[3, 0] == float("-inf") and out[3, 1:].tolist() == [2.0, 8.0]
    # top_p cuts the least likely tokens outside the requested mass
    p = sv.constrain_targets(torch.tensor([[4.0, 0.0, -4.0]]), 1, torch.tensor([1.0]), None, torch.tensor([0.9]))
    assert p[0, 0] == 4.0 and p[0, 2] == float("-inf")


def params(**fields):
    defaults = dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, bad_words=None,
                    allowed_token_ids=None, min_tokens=0, logprobs=None, temperature=0.7, top_p=0.99, seed=None)
    return SimpleNamespace(**{**defaults, **fields})


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 0.5), ("frequency_penalty", -0.2), ("repetition_penalty", 1.1), ("bad_words", ["x"]),
    ("allowed_token_ids", [1, 2]), ("min_tokens", 3), ("logprobs", 0)])
def test_each_unverifiable_field_is_refused_by_name_on_hpu_with_speculation(field, value):
    refusal = sv.request_refusal(params(**{field: value}), model_type="beam", speculative=True, device_type="hpu")
    assert refusal is not None and refusal[0] == field
    assert refusal[1].startswith(f"{field} cannot be served with speculative decoding on Gaudi")
    # not on CPU, not without speculation, not for another model
    for where in (dict(model_type="beam", speculative=True, device_type="cpu"),
                  dict(model_type="beam", speculative=False, device_type="hpu"),
                  dict(model_type="llama", speculative=True, device_type="hpu")):
        assert sv.request_refusal(params(**{field: value}), **where) is None


def test_what_the_verify_step_serves_is_not_refused():
    for ok in (params(), params(temperature=0.0), params(seed=7, top_p=1.0), params(temperature=1.3)):
        assert sv.request_refusal(ok, model_type="beam", speculative=True, device_type="hpu") is None


def test_every_field_found_is_named():
    refusal = sv.request_refusal(params(presence_penalty=1.0, logprobs=2), model_type="beam", speculative=True,
                                 device_type="hpu")
    assert refusal[0] == "presence_penalty" and refusal[1].startswith("presence_penalty, logprobs cannot")
