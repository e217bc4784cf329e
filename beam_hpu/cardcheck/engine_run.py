"""One setting of card-check's engine A/B, in a process of its own (the switch's environment is set
before vLLM is imported; port switches are read when the model loads): vLLM's engine started with
the given flags, stepped by hand so every scheduler step is timed, and the figures written as JSON.

    python -m beam_hpu.cardcheck.engine_run SPEC.json OUT.json

SPEC: {"model", "engine": {LLM keyword arguments}, "batches": [1, 4, 16], "decode_steps",
"contexts": [prompt lengths for TTFT], "prompt_len", "seed"}.
Decode prompts end by restarting their passage (COPY_RESTART); TTFT prompts are random ids.
OUT: the engine's start (process start to ready) and its first request's first token after it;
per batch size the median decode step (ms, steps after every request has its first token),
the first run's extra time over the second (graph compilation and warm-up, counted apart), the
greedy tokens of each request; TTFT per context (median of the repeats after a warm-up); tokens per
second at one stream; vLLM's speculative-decoding counters where it drafted.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

# Repeats per TTFT context after its warm-up request: the median of these is reported.
TTFT_REPEATS = 3
# A decode prompt ends by restarting its passage (the copy gate's shape): the continuation is the
# passage again, which a drafter can follow, so the DFlash2 setting is measured on text it can draft
# and not on noise no drafter predicts.
COPY_RESTART = 8


def prompts(count: int, length: int, vocab: int, seed: int, restart: int = 0) -> list[list[int]]:
    """`count` prompts of `length` token ids, deterministic from `seed` (ids past the first 8, which
    tokenizers keep for special tokens); with `restart`, each passage's first `restart` ids again at
    its end."""
    import torch

    g = torch.Generator().manual_seed(seed)
    passages = torch.randint(8, vocab, (count, length - restart), generator=g).tolist()
    return [p + p[:restart] for p in passages]


class SteppedEngine:
    def __init__(self, llm):
        self.engine = llm.llm_engine
        self.next_id = 0

    def run(self, token_ids: list[list[int]], max_tokens: int) -> tuple[list[tuple[float, bool]], list[list[int]]]:
        """Each step's (ms, whether every request already had a token before it: a decode-only step),
        and each request's greedy tokens."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        ids = []
        for prompt in token_ids:
            request_id = f"ab-{self.next_id}"
            self.next_id += 1
            self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            ids.append(request_id)
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        steps = []
        while self.engine.has_unfinished_requests():
            decode_only = all(tokens[i] for i in ids)
            start = time.perf_counter()
            outputs = self.engine.step()
            steps.append(((time.perf_counter() - start) * 1e3, decode_only))
            for out in outputs:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        return steps, [tokens[i] for i in ids]


def spec_counters(llm) -> dict[str, float]:
    """vLLM's speculative-decoding counters so far (empty without speculation)."""
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out = {}
    for metric in llm.get_metrics():
        key = names.get(metric.name.removesuffix("_total"))
        if key is not None:
            out[key] = out.get(key, 0.0) + float(metric.value)
    return out


def measure(spec: dict, started: float) -> dict:
    """`started`: perf_counter() when this process began (vLLM not yet imported)."""
    from vllm import LLM

    from beam_hpu.cardcheck.graph_probe import EXTENSION, summarise

    llm = LLM(model=spec["model"], disable_log_stats=False, seed=spec["seed"], worker_extension_cls=EXTENSION,
              **spec["engine"])
    vocab = llm.llm_engine.model_config.get_vocab_size()
    stepped = SteppedEngine(llm)
    result: dict = {"decode": {}, "ttft_ms": {}, "engine_start_ms": (time.perf_counter() - started) * 1e3}
    for batch in spec["batches"]:
        batch_prompts = prompts(batch, spec["prompt_len"], vocab, spec["seed"] + batch, COPY_RESTART)
        runs, windows = [], []
        for _ in range(2):  # the first compiles (and warms up); the second is the measured one
            llm.collective_rpc("beam_probe_start")
            start = time.perf_counter()
            steps, tokens = stepped.run(batch_prompts, spec["decode_steps"])
            runs.append(((time.perf_counter() - start) * 1e3, steps, tokens))
            windows.append(llm.collective_rpc("beam_probe_read"))
        (first_ms, first_steps, _), (second_ms, steps, tokens) = runs
        if "start_to_first_token_ms" not in result:  # the engine's first request: what a restart costs
            result["start_to_first_token_ms"] = result["engine_start_ms"] + sum(
                ms for ms, decode_only in first_steps[:next((i for i, (_, d) in enumerate(first_steps) if d),
                                                           len(first_steps))])
        decode = [ms for ms, decode_only in steps if decode_only]
        generated = sum(len(t) for t in tokens)
        result["decode"][str(batch)] = {
            "step_ms": statistics.median(decode) if decode else None, "steps": len(decode),
            "compile_ms": max(first_ms - second_ms, 0.0), "run_ms": second_ms,
            "tok_s": generated / (second_ms / 1e3), "tokens": tokens, "node": summarise(*windows)}
    before = spec_counters(llm)
    for context in spec["contexts"]:
        context_prompt = prompts(1, context, vocab, spec["seed"] + context)
        times = []
        for _ in range(1 + TTFT_REPEATS):  # the first compiles the context's prefill graph
            steps, _ = stepped.run(context_prompt, 1)
            times.append(sum(ms for ms, _ in steps))
        result["ttft_ms"][str(context)] = statistics.median(times[1:])
    counters = spec_counters(llm)
    result["spec"] = counters
    if counters.get("drafts"):
        # Counted over the decode runs (the TTFT requests draft nothing: one token each).
        accepted = before.get("accepted", 0.0)
        drafts = before.get("drafts", 0.0)
        result["accepted_length"] = 1 + accepted / drafts if drafts else None
    return result


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    spec_path, out_path = (argv or sys.argv[1:])[:2]
    out = measure(json.loads(Path(spec_path).read_text()), started)
    Path(out_path).write_text(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
