"""The gates' endpoint calls that need no chat layer, answered by an offline `LLM` in this process.

`beam_hpu.gates.client.Endpoint` asks a server; this asks the engine the server would run, through
the same request path below the HTTP layer (`LLM.generate` with `prompt_logprobs`, the call behind
the completions API's `prompt_logprobs`). It answers `tokenize` and `prompt_top`, which is all the
perplexity gate uses; a gate that chats (copy, needles, tools) fails here with AttributeError.
Tests use it to judge several broken checkpoints in one process instead of one server each; at
least one broken checkpoint is still judged through `vllm serve` (tests/gates/test_gates_served.py).
"""

from __future__ import annotations


class OfflineEndpoint:
    def __init__(self, llm, tokenizer_dir: str):
        from transformers import AutoTokenizer

        self.llm = llm
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    def tokenize(self, text: str) -> list[int]:
        # What vLLM's /tokenize answers for {"prompt": text, "add_special_tokens": false}.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_top(self, prompt_ids: list[int], k: int) -> list[tuple[dict[int, float], int] | None]:
        """Per prompt position: {token id: logprob} for the top-k and the actual token, and the
        rank-1 token ([None] first), as `Endpoint.prompt_top` reads them from the server."""
        from vllm import SamplingParams

        out = self.llm.generate([{"prompt_token_ids": prompt_ids}],
                                SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k), use_tqdm=False)
        rows = []
        for pos in out[0].prompt_logprobs:
            if pos is None:
                rows.append(None)
                continue
            top = min(pos.items(), key=lambda kv: kv[1].rank)[0]
            rows.append(({int(t): float(lp.logprob) for t, lp in pos.items()}, int(top)))
        return rows
