"""Helpers shared by the gates: filler of a given token length, markup checks."""

from __future__ import annotations

import random

from beam_hpu.parsers.template import CONTROL_TOKEN_RE, bundled_template
from beam_hpu.tiny import tasks as syn

# A tool-call parameter opener, as the published response template frames it.
PARAMETER_OPENER = bundled_template().parameter_begin[0].split(" ")[0]


def has_markup(text: str) -> bool:
    """Whether text meant for the client still carries Beam's markup (a control token, or a
    tool-call parameter) that the parsers should have taken out."""
    text = text or ""
    return bool(CONTROL_TOKEN_RE.search(text)) or PARAMETER_OPENER in text


class Filler:
    """Filler text of about n tokens, measured once against the server's tokenizer."""

    def __init__(self, ep, pieces: list[str], seed: int):
        self.ep = ep
        self.pieces = list(pieces)
        self.rng = random.Random(seed)
        sample = syn.filler_text(random.Random(seed + 1), 400, self.pieces)
        self.tokens_per_piece = len(ep.tokenize(sample)) / 400

    def text(self, n_tokens: int) -> str:
        return syn.filler_text(self.rng, max(0, int(n_tokens / self.tokens_per_piece)), self.pieces)

    def ids(self, n_tokens: int) -> list[int]:
        """Exactly n_tokens ids (tokenized filler, cut)."""
        ids = self.ep.tokenize(self.text(int(n_tokens * 1.1) + 8))
        while len(ids) < n_tokens:
            ids += self.ep.tokenize(self.text(n_tokens - len(ids) + 8))
        return ids[:n_tokens]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]
