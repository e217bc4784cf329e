"""One vLLM engine (offline LLM, in this process) on a tiny non-Beam checkpoint, reporting what
tests/runtime/test_scope.py compares between the plugin on and plugins off (`VLLM_PLUGINS=`):

    python -m tests.support.scope_engine SPEC.json OUT.json

- `patched`: which of vLLM's patch targets carry one of our marks (none with plugins off);
- `layers`: for every module with a quant method, its class, the quant method's class, and for
  an FP8 linear the kernel's class and what quantises its activations;
- `greedy`: greedy token ids for each prompt;
- `schedule` (spec "schedule": true): benchmarks/prefill_inflight.py's prompt-first scenario
  (decodes admitted behind a chunked prompt in a small KV pool) with BEAM_PREFILL_INFLIGHT=1,
  counted in scheduler steps: each decode's largest gap, preemptions, the prompt's last step.
A model vLLM refuses at load writes nothing: the test reads the refusal from the output.
Nothing here imports beam_hpu: with plugins off it must not be loaded at all.
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model and scheduler are readable here
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# Prompt-first, scaled to a full-attention model: the prompt and the decodes do not fit the pool
# together (19 + 4 x 4 blocks of 32 > 26; vLLM-CPU attention takes multiples of 32), so stock vLLM
# preempts decodes for the prompt.
SCHEDULE = dict(PROMPT_TOKENS=600, DECODES=4, DECODE_PROMPT=40, DECODE_TOKENS=64)
SCHEDULE_ENGINE = dict(block_size=32, max_model_len=640, max_num_batched_tokens=192, max_num_seqs=8,
                       enable_chunked_prefill=True, long_prefill_token_threshold=16, num_gpu_blocks_override=26,
                       async_scheduling=False)
TARGETS = {  # where our runtime patches sit (beam_hpu/runtime/__init__.py), read without importing beam_hpu
    "prefill-inflight": ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    "cpu-fp8-dense-rounding": ("vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel",
                               "FP8ScaledMMLinearKernel", "__init__"),
    "portable-fp8-moe": ("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
                         "compressed_tensors_moe", "CompressedTensorsMoEMethod", "get_moe_method"),
}


def describe(obj) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__qualname__


def layer_inventory(model) -> dict:
    layers = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        row = [type(module).__qualname__, type(method).__qualname__]
        scheme = getattr(module, "scheme", None)
        kernel = getattr(scheme, "fp8_linear", None)
        if kernel is not None:
            row += [type(kernel).__qualname__, describe(kernel.quant_fp8)]
        layers[name] = row
    return layers


def patch_marks() -> dict:
    import importlib

    marks = {}
    for patch, (module, cls, attr) in TARGETS.items():
        raw = vars(getattr(importlib.import_module(module), cls))[attr]
        raw = getattr(raw, "__func__", raw)
        marks[patch] = getattr(raw, "__beam_hpu_patch__", None)
    return marks


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, skip_tokenizer_init=True, seed=0,
              enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20,
              **(SCHEDULE_ENGINE if spec.get("schedule") else {"max_model_len": 512}))
    print("SCOPE-LOADED", flush=True)
    out = {"patched": patch_marks(), "layers": llm.apply_model(layer_inventory)[0]}
    if spec.get("schedule"):
        sys.path.insert(0, os.getcwd())
        from benchmarks import prefill_inflight as scenario

        for key, value in SCHEDULE.items():
            setattr(scenario, key, value)
        out["schedule"] = scenario.run_once(llm.llm_engine, "prompt-first", True, "s")
    params = SamplingParams(max_tokens=spec.get("max_tokens", 12), temperature=0.0, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": ids} for ids in spec["prompts"]], params, use_tqdm=False)
    out["greedy"] = [list(r.outputs[0].token_ids) for r in results]
    return out


if __name__ == "__main__":
    spec_path, out_path = sys.argv[1:3]
    with open(spec_path) as f:
        result = run(json.load(f))
    with open(out_path, "w") as f:
        json.dump(result, f)
