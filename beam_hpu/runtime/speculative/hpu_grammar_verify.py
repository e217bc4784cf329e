"""Grammar masks on the rows of a speculative verify step, so that drafts are verified under the grammar.

vLLM's scheduler sends one packed bitmask row per token it will check: for each grammar request,
in `structured_output_request_ids` order, 1 + len(scheduled spec tokens) rows. Row i of a request
is the grammar's mask after its last accepted token and its first i drafts (the scheduler advances
the grammar through the drafts, fills the rows, then rolls it back); the last row is the bonus
position's. A request without drafts (a prompt, or a decode nothing was drafted for) has one row.

vllm-gaudi's verify logits hold decode sequence b's rows at b * rows_per_sequence + i (the flat
decode layout: rows_per_sequence = the step's k + 1, padding rows after a sequence's own). Masking
row i with the request's bitmask row i, and each prompt's one row with its bitmask row, makes the
rejection sampler's target and bonus logits the grammar-masked ones: a draft the grammar forbids
is never the target's argmax, so it is rejected, and the replacement and bonus tokens obey the
grammar. The masking itself is `grammar_mask.apply_token_bitmask` (tested against xgrammar).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from beam_hpu.runtime.grammar.hpu_device_mask import apply_token_bitmask

RowSpans = Mapping[str, tuple[int, int]]  # request id -> (its first logits row, its number of rows)


def verify_row_spans(decode_req_ids: Sequence[str], scheduled_spec_decode_tokens: Mapping[str, Sequence[int]],
                     num_rows: int, num_layout_sequences: int) -> dict[str, tuple[int, int]]:
    """Rows of each decode request in vllm-gaudi's flat verify layout: num_rows logits rows for
    num_layout_sequences (padded) sequences, sequence b at b * (num_rows / num_layout_sequences)."""
    if num_layout_sequences < len(decode_req_ids) or num_layout_sequences < 1 or num_rows % num_layout_sequences:
        raise ValueError(f"verify logits: {num_rows} rows are not whole rows for {num_layout_sequences} sequences "
                         f"({len(decode_req_ids)} decodes)")
    stride = num_rows // num_layout_sequences
    spans = {}
    for b, req_id in enumerate(decode_req_ids):
        count = 1 + len(scheduled_spec_decode_tokens.get(req_id, ()))
        if count > stride:
            raise ValueError(f"verify logits: request {req_id!r} has {count} positions, "
                             f"the layout {stride} per sequence")
        spans[req_id] = (b * stride, count)
    return spans


def owner_row_spans(row_owners: Sequence[str]) -> dict[str, tuple[int, int]]:
    """One row per owner (prompts): a request owning several rows keeps its last, as so-row-owners does."""
    return {req_id: (row, 1) for row, req_id in enumerate(row_owners)}


def grammar_row_pairs(structured_output_request_ids: Sequence[str],
                      scheduled_spec_decode_tokens: Mapping[str, Sequence[int]],
                      row_spans: RowSpans) -> tuple[list[int], list[int]]:
    """(logits rows, bitmask rows), pairwise: which scheduler bitmask row masks which logits row.
    A grammar request without rows here (a prompt chunk that samples nothing) only advances the
    bitmask cursor past its rows."""
    logit_rows, mask_rows = [], []
    cursor = 0
    for req_id in structured_output_request_ids:
        positions = 1 + len(scheduled_spec_decode_tokens.get(req_id, ()))
        if req_id in row_spans:
            start, count = row_spans[req_id]
            for i in range(min(positions, count)):
                logit_rows.append(start + i)
                mask_rows.append(cursor + i)
        cursor += positions
    return logit_rows, mask_rows


def apply_grammar_rows(logits: torch.Tensor, grammar_bitmask: np.ndarray | torch.Tensor,
                       structured_output_request_ids: Sequence[str],
                       scheduled_spec_decode_tokens: Mapping[str, Sequence[int]], row_spans: RowSpans) -> None:
    """Mask, in place on the logits' device, every logits row of `row_spans` with its grammar row;
    rows of requests without a grammar, and padding rows, are left alone."""
    logit_rows, mask_rows = grammar_row_pairs(structured_output_request_ids, scheduled_spec_decode_tokens, row_spans)
    if not logit_rows:
        return
    bitmask = grammar_bitmask.numpy() if isinstance(grammar_bitmask, torch.Tensor) else np.asarray(grammar_bitmask)
    if mask_rows[-1] >= bitmask.shape[0]:
        raise ValueError(f"grammar bitmask has {bitmask.shape[0]} rows; the scheduled tokens of "
                         f"{len(structured_output_request_ids)} grammar requests need {mask_rows[-1] + 1}")
    if max(logit_rows) >= logits.shape[0]:
        raise ValueError(f"grammar rows reach logits row {max(logit_rows)}; the logits have {logits.shape[0]}")
    placed = np.full((logits.shape[0], bitmask.shape[1]), -1, dtype=np.int32)
    placed[logit_rows] = bitmask[mask_rows]
    apply_token_bitmask(logits, placed, indices=logit_rows)
