"""How sure the tiny trained Beam is of each token it writes: the gap, in nats, between its greedy
token and the runner-up at every step of a temperature-0 answer.

An answer that a test, a gate or the README relies on must not sit on a near-tie: bf16 kernels
round differently on different CPUs (with and without AVX512), and a gap of a few hundredths of a
nat flips with them (seen: the README's first tool-call example chose between `days` and closing
the call with a gap of 0.06 nats). The gap is taken over the whole vocabulary, so it is a lower
bound of the margin under the response grammar, which only removes competitors.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    token: str
    gap: float  # logprob(greedy token) - logprob(runner-up), nats
    runner_up: str


def greedy_with_margins(model, tokenizer, messages: list[dict], tools: list[dict] | None = None,
                        max_tokens: int = 128) -> list[Step]:
    """The greedy continuation of the chat prompt, up to and with the first stop token."""
    import torch

    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(ids, add_special_tokens=False).input_ids
    stops = set(model.generation_config.eos_token_id or [])
    steps: list[Step] = []
    for _ in range(max_tokens):
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)  # [V]
        top = logprobs.topk(2)
        token = int(top.indices[0])
        steps.append(Step(tokenizer.decode([token]), float(top.values[0] - top.values[1]),
                          tokenizer.decode([int(top.indices[1])])))
        ids.append(token)
        if token in stops:
            break
    return steps


def smallest(steps: list[Step]) -> Step:
    return min(steps, key=lambda s: s.gap)
