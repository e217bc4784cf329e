"""vLLM 0.30.0's sampling and speculative-decoding metadata as its GPU-less runner builds them for
a verify step: one request per temperature, each request's draft positions then its bonus one."""
from __future__ import annotations

import torch


def sampling_metadata(temperature: list[float], vocab: int, generators=None):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    b = len(temperature)
    t = torch.tensor(temperature)
    return SamplingMetadata(
        temperature=t, all_greedy=all(x == 0 for x in temperature), all_random=all(x > 0 for x in temperature),
        top_p=None, top_k=None, generators=generators or {}, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(b), presence_penalties=torch.zeros(b),
        repetition_penalties=torch.ones(b), output_token_ids=[[] for _ in range(b)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def spec_metadata(drafts: list[list[int]]):
    """Logits laid out as the runner does: each request's draft positions, then its bonus position."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    meta = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    target, bonus, start = [], [], 0
    for row in drafts:
        target += range(start, start + len(row))
        bonus.append(start + len(row))
        start += len(row) + 1
    meta.target_logits_indices = torch.tensor(target, dtype=torch.int32)
    meta.bonus_logits_indices = torch.tensor(bonus, dtype=torch.int32)
    return meta
