"""Grammar rows on a verify step (beam_hpu.runtime.speculative.hpu_grammar_verify): against vLLM 0.30.0's own
apply_grammar_bitmask (the GPU runner's row layout, run here on CPU with xgrammar's kernel) where
the layouts coincide, and against the definition (row i of a request masked with its bitmask row
i, every other row untouched) on vllm-gaudi's padded verify layout and for prompts by owner."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("xgrammar")

from beam_hpu.runtime.speculative.hpu_grammar_verify import (  # noqa: E402
    apply_grammar_rows, grammar_row_pairs, owner_row_spans, verify_row_spans)

VOCAB = 100  # not a multiple of 32: the last bitmask word is partly past the vocabulary
WORDS = (VOCAB + 31) // 32


def random_masks(rows: int, seed: int) -> np.ndarray:
    """Packed bitmask rows, each allowing a random fifth of the vocabulary (at least one token)."""
    rng = np.random.default_rng(seed)
    allowed = rng.random((rows, WORDS * 32)) < 0.2
    allowed[np.arange(rows), rng.integers(0, VOCAB, rows)] = True
    bits = allowed.reshape(rows, WORDS, 32).astype(np.int64) << np.arange(32)
    return bits.sum(-1).astype(np.uint32).view(np.int32)


def allowed_tokens(packed_row: np.ndarray) -> torch.Tensor:
    """The definition of a packed row: bit b of word w allows token 32 * w + b."""
    words = packed_row.astype(np.int64) & 0xFFFFFFFF
    return torch.tensor([bool((words[t // 32] >> (t % 32)) & 1) for t in range(VOCAB)])


def masked_by_definition(logits, bitmask, pairs):
    expected = logits.clone()
    for row, mask_row in zip(*pairs):
        expected[row, ~allowed_tokens(bitmask[mask_row])] = float("-inf")
    return expected


@pytest.mark.parametrize("seed", [0, 1])
def test_equals_vllm_apply_grammar_bitmask_on_the_compact_layout(seed):
    """Every decode has k drafts, so vllm-gaudi's layout (stride k+1) is vLLM's GPU layout."""
    from vllm.v1.structured_output.utils import apply_grammar_bitmask

    k = 3
    req_ids = ["a", "b", "c", "d"]
    grammar_ids = ["c", "a", "d"]  # the scheduler's order, not the batch's; "b" has no grammar
    spec = {r: list(range(10, 10 + k)) for r in req_ids}
    bitmask = random_masks(len(grammar_ids) * (k + 1), seed)
    logits = torch.randn(len(req_ids) * (k + 1), VOCAB, generator=torch.Generator().manual_seed(seed))
    expected = logits.clone()
    apply_grammar_bitmask(SimpleNamespace(scheduled_spec_decode_tokens=spec),
                          SimpleNamespace(grammar_bitmask=bitmask, structured_output_request_ids=grammar_ids),
                          SimpleNamespace(req_ids=req_ids), expected)
    got = logits.clone()
    apply_grammar_rows(got, bitmask, grammar_ids, spec, verify_row_spans(req_ids, spec, got.shape[0], len(req_ids)))
    assert torch.equal(got, expected)
    assert torch.isinf(got).any() and torch.equal(got[k + 1:2 * (k + 1)], logits[k + 1:2 * (k + 1)])  # "b" untouched


def test_padded_verify_layout_by_the_definition():
    """vllm-gaudi's layout: stride = the step's k+1, a decode with fewer drafts leaves padding
    rows, the decode batch is padded with whole sequences; none of those rows is touched."""
    stride, sequences = 5, 4  # k = 4, a padded batch of 4 for 3 decodes
    req_ids = ["x", "y", "z"]
    spec = {"x": [1, 2, 3, 4], "y": [7], "z": []}
    grammar_ids = ["z", "y", "x"]
    bitmask = random_masks(1 + 2 + 5, 2)
    logits = torch.randn(sequences * stride, VOCAB, generator=torch.Generator().manual_seed(2))
    spans = verify_row_spans(req_ids, spec, logits.shape[0], sequences)
    assert spans == {"x": (0, 5), "y": (5, 2), "z": (10, 1)}
    pairs = grammar_row_pairs(grammar_ids, spec, spans)
    # z's one row is bitmask row 0, y's two rows 1-2, x's five rows 3-7
    assert pairs == ([10, 5, 6, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7])
    got = logits.clone()
    apply_grammar_rows(got, bitmask, grammar_ids, spec, spans)
    assert torch.equal(got, masked_by_definition(logits, bitmask, pairs))
    untouched = [7, 8, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    assert torch.equal(got[untouched], logits[untouched])


def test_prompt_rows_by_owner_skip_grammar_requests_without_a_row():
    # "q" is a prompt chunk that sampled nothing: its bitmask row is skipped, not given to "p"
    grammar_ids = ["q", "p", "d"]
    spec = {"d": [5, 6]}
    bitmask = random_masks(1 + 1 + 3, 3)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    spans = owner_row_spans(["r", "p"])  # "r" has no grammar
    pairs = grammar_row_pairs(grammar_ids, spec, spans)
    assert pairs == ([1], [1])
    got = logits.clone()
    apply_grammar_rows(got, bitmask, grammar_ids, spec, spans)
    assert torch.equal(got, masked_by_definition(logits, bitmask, pairs))


def test_errors_name_the_mismatch():
    with pytest.raises(ValueError, match="request 'x' has 4 positions, the layout 3"):
        verify_row_spans(["x"], {"x": [1, 2, 3]}, 6, 2)
    with pytest.raises(ValueError, match="not whole rows"):
        verify_row_spans(["x"], {}, 7, 2)
    with pytest.raises(ValueError, match="bitmask has 2 rows"):
        apply_grammar_rows(torch.zeros(4, VOCAB), random_masks(2, 0), ["x"], {"x": [1, 2]},
                           verify_row_spans(["x"], {"x": [1, 2]}, 4, 1))
