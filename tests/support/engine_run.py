"""Run one vLLM engine (offline `LLM`) on a checkpoint and answer a list of token-id jobs.

Run as a subprocess (`python -m tests.support.engine_run SPEC.json OUT.json`): every engine config
gets a clean process, as vLLM expects, and pytest's process never holds an engine.
Jobs:
  {"prompt_logprobs": [ids]}             -> logprob of each prompt token given its prefix
  {"greedy": [ids], "max_tokens": n}     -> greedy token ids and their logprobs
  {"decode_vs_prefill": [ids], "max_tokens": n} -> decoded logprobs and the same tokens' prompt logprobs
"""

import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        tensor_parallel_size=spec.get("tp", 1),
        enable_expert_parallel=spec.get("ep", False),
        load_format=spec.get("load_format", "auto"),
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 1024),
        kv_cache_memory_bytes=spec.get("kv_cache_bytes", 64 << 20),
        skip_tokenizer_init=True,
        seed=0,
        # Off unless asked: a prefix-cache hit would skip the very prefill a test compares against.
        enable_prefix_caching=spec.get("prefix_caching", False),
        **spec.get("engine_kwargs", {}),
    )
    results = []
    for job in spec["jobs"]:
        if "prompt_logprobs" in job:
            ids = job["prompt_logprobs"]
            out = llm.generate([{"prompt_token_ids": ids}],
                               SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
            pl = out[0].prompt_logprobs
            results.append({"prompt_logprobs": [None] + [pl[i][ids[i]].logprob for i in range(1, len(ids))]})
        elif "greedy" in job:
            out = llm.generate([{"prompt_token_ids": job["greedy"]}],
                               SamplingParams(max_tokens=job["max_tokens"], temperature=0, logprobs=0,
                                              ignore_eos=True), use_tqdm=False)
            o = out[0].outputs[0]
            results.append({"tokens": list(o.token_ids),
                            "logprobs": [o.logprobs[i][t].logprob for i, t in enumerate(o.token_ids)]})
        elif "decode_vs_prefill" in job:
            # Greedy-decode past the window, then re-feed prompt + output as one prompt: each decoded
            # token's logprob must equal its prompt logprob (paged decode vs prefill attention).
            ids, n = job["decode_vs_prefill"], job["max_tokens"]
            out = llm.generate([{"prompt_token_ids": ids}],
                               SamplingParams(max_tokens=n, temperature=0, logprobs=0, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
            full = ids + list(out.token_ids)
            again = llm.generate([{"prompt_token_ids": full}],
                                 SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                                 use_tqdm=False)[0].prompt_logprobs
            results.append({"tokens": list(out.token_ids),
                            "decode": [out.logprobs[i][t].logprob for i, t in enumerate(out.token_ids)],
                            "prefill": [again[len(ids) + i][t].logprob for i, t in enumerate(out.token_ids)]})
        else:
            raise ValueError(f"unknown job {job}")
    return {"results": results}


if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    json.dump(run(spec), open(sys.argv[2], "w"))
