"""Prompts the engine tests share: short passages of the tiny tokenizer's words (the reference and
FP8 accuracy tests), and per checkpoint a random-token prompt many windows long plus one of real
text (the model-vs-oracle tests)."""

import random

PROMPTS = [
    "the model reads a passage and writes an answer . we check each token of the output against the reference",
    "hello world please think step by step then answer briefly . yes no true false",
    '{"city": "Paris", "days": 2, "ok": true, "list": [1, 2, 3]} numbers 0 1 2 3 4 5 6 7 8 9 10 42 100',
]


def prompts(model_dir, n_random=200, seed=0):
    """A random-token prompt many windows long and a prompt of real text from the tokenizer."""
    from transformers import AutoTokenizer

    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = "the model reads a passage and writes an answer . " * 12
    return [[rng.randrange(8, len(tok)) for _ in range(n_random)], tok.encode(text)]
