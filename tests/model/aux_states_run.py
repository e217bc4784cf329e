"""Run one vLLM engine on a checkpoint with EAGLE3 auxiliary layers set, and dump the states the
model returns for one prompt's prefill: `python -m tests.model.aux_states_run SPEC.json OUT.json`.

A subprocess, like tests/support/engine_run.py: each engine gets a clean process. The auxiliary
layers are set through the model's own `set_aux_hidden_state_layers` (what vLLM's runner calls for
an EAGLE3 drafter); a forward hook on each worker's model keeps the (hidden, aux) pair and hands the
runner only the hidden states, since no drafter is there to take the aux list.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# LLM.apply_model ships functions to the workers by pickle, which vLLM allows only when asked.
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"


def arm(layers, model):
    """In each worker: set the auxiliary layers and keep the first forward's aux states."""
    def keep(module, args, output):
        if isinstance(output, tuple) and not hasattr(module, "kept_aux"):
            module.kept_aux = [a.float().tolist() for a in output[1]]
        return output[0] if isinstance(output, tuple) else output

    model.set_aux_hidden_state_layers(tuple(layers))
    model.register_forward_hook(keep)
    return list(model.model.aux_hidden_state_layers)


def collect(model):
    import torch

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return {"rank": rank, "aux": model.kept_aux,
            "default_layers": list(model.get_eagle3_default_aux_hidden_state_layers())}


def run(spec: dict) -> dict:
    import functools

    from vllm import LLM, SamplingParams

    from tests.model.aux_states_run import arm as arm_fn, collect as collect_fn

    llm = LLM(model=spec["model"], dtype="float32", tensor_parallel_size=spec.get("tp", 1), enforce_eager=True,
              max_model_len=1024, kv_cache_memory_bytes=64 << 20, skip_tokenizer_init=True, seed=0,
              enable_prefix_caching=False)
    set_layers = llm.apply_model(functools.partial(arm_fn, spec["layers"]))
    llm.generate([{"prompt_token_ids": spec["ids"]}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    ranks = sorted(llm.apply_model(collect_fn), key=lambda r: r["rank"])
    llm.llm_engine.engine_core.shutdown()
    return {"set_layers": set_layers, "ranks": ranks}


if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    with open(sys.argv[2], "w") as f:
        json.dump(run(spec), f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see tests/support/engine_run.py: vLLM-CPU's C++ teardown may abort at exit
