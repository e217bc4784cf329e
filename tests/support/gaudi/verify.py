"""A speculative verify step of a (patched) vllm-gaudi tree: HPUModelRunner.sample_tokens from the
decode forward through the read-back of the sampled tokens, taken from the file, with the tree's
own rejection sampler, and the grammar bitmasks and greedy targets its tests compare with."""
from __future__ import annotations

import ast

import numpy as np
import torch

from tests.support.gaudi.source import RUNNER_CLS, find_def, load


class HostTensor(torch.Tensor):
    """A CPU tensor whose `.to("hpu")` (the runner keeps the verified tokens on the card) stays here."""

    def to(self, *args, **kwargs):
        if args and args[0] == "hpu":
            return self
        return super().to(*args, **kwargs)


def pack(allowed: list[set[int]], vocab: int) -> np.ndarray:
    """The grammar bitmask of rows allowing `allowed[r]`, as xgrammar packs it (32 tokens a word)."""
    words = np.zeros((len(allowed), vocab // 32), dtype=np.int64)
    for r, tokens in enumerate(allowed):
        for t in tokens:
            words[r, t // 32] |= 1 << (t % 32)
    return words.astype(np.uint32).view(np.int32)


def masked_argmax(row: torch.Tensor, allowed: set[int] | None) -> int:
    if allowed is None:
        return int(row.argmax())
    return max(allowed, key=lambda t: float(row[t]))


def sample_tokens_statements(path, port: bool) -> list[ast.stmt]:
    """sample_tokens from the decode forward through the read-back of the sampled tokens (the
    port's verify_under_grammar assignment first, after its import: the first two statements)."""
    body = find_def(ast.parse(path.read_text()), "sample_tokens", RUNNER_CLS).body
    start = next(i for i, n in enumerate(body) if isinstance(n, ast.If) and ast.unparse(n.test) == "num_decodes > 0")
    end = next(i for i, n in enumerate(body) if i > start and isinstance(n, ast.If)
               and ast.unparse(n.test) == "self.use_async_scheduling")
    at = [i for i, n in enumerate(body) if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "verify_under_grammar"]
    assert len(at) == (1 if port else 0)
    # the port's assignment asks beam_hpu.scope, imported on the line before it
    head = [body[at[0] - 1], body[at[0]]] if at else []
    assert not head or (isinstance(head[0], ast.ImportFrom) and head[0].module == "beam_hpu.scope")
    return head + body[start:end + 1]


def use_tree_rejection_sample(root, monkeypatch) -> None:
    """vLLM's rejection_sample replaced by the tree's own (hpu_rejection_sampler.py), as on the card."""
    from vllm.v1.sample import rejection_sampler as vllm_rejection

    gaudi_sampler = root / "vllm_gaudi/v1/sample/hpu_rejection_sampler.py"
    helpers = dict(torch=torch, rejection_sampler=vllm_rejection, Optional=object, SamplingMetadata=object,
                   PLACEHOLDER_TOKEN_ID=vllm_rejection.PLACEHOLDER_TOKEN_ID)
    pytorch_sample = load(gaudi_sampler, "rejection_sample_pytorch", **helpers)
    monkeypatch.setattr(vllm_rejection, "rejection_sample",
                        load(gaudi_sampler, "rejection_sample", rejection_sample_pytorch=pytorch_sample, **helpers))
