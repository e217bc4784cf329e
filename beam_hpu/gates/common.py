"""Helpers shared by the gates: filler of a given token length, markup checks."""

from __future__ import annotations

import random

from beam_hpu import synthetic as syn

MARKUP = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>",
          "<|endoftext|>", "<rfl:parameter")


def has_markup(text: str) -> bool:
    return any(m in (text or "") for m in MARKUP)


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
