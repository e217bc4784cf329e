"""Every key vLLM 0.30.0's `SpeculativeConfig` takes, and what the port's DFlash2 path does with it
for a Beam target with Beam's DFlash2 drafter (`"method": "dflash"`): the CPU proposer
(`runtime/speculative/cpu_dflash2_proposer.py`, driven by vLLM's V1 runner) and the Gaudi one
(`hpu_dflash2_proposer.py`, driven by vllm-gaudi's runner through the port unit
`beam-dflash2-proposer`).

A key falls in one of four groups:
- `HONOURED`: read by the engine or the proposers on both devices, whatever its value;
- `OPTIONS`: a key the path does not read on some device; a launch that sets it there to
  anything but what the path does anyway is refused by the guard rule `dflash2_options`, naming
  the key and what is supported;
- `VLLM_REFUSES`: keys vLLM's own `SpeculativeConfig` refuses for method dflash;
- `ENGINE_SET`: filled in by the engine, not by a launch.
`tests/settings/test_guard_dflash2_options.py` checks the four against the installed vLLM's fields
and defaults, so a key vLLM adds is classified before a launch can set it unnoticed.

Plain data: nothing here imports vLLM or torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

BOTH = ("cpu", "hpu")
HPU = ("hpu",)

# What reads each key the DFlash2 path honours on both devices.
HONOURED = {
    "method": "selects the port's DFlash2 proposers (rule dflash_drafter admits only Beam's drafter)",
    "model": "the drafter checkpoint vLLM builds the draft model config from",
    "num_speculative_tokens": "the block: the bonus token and this many mask rows",
    "revision": "the drafter checkpoint's revision (vLLM's draft model config downloads it)",
    "code_revision": "vLLM's draft model config",
    "draft_load_config": "the drafter's load config (CPU: vLLM's proposer base; Gaudi: HpuDFlash2Proposer.load_model)",
    "disable_eagle_block_drop": "vLLM's scheduler and KV cache manager (use_eagle_block_drop), on both devices",
    "parallel_drafting": "vLLM sets it for dflash: the block is drafted in one forward",
    "draft_sample_method": "the selector walk, greedy or sampled at each request's temperature (both proposers; "
                           "CPU verifies against the draws' probabilities, Gaudi as point masses)",
    # with rejection_sample_method 'synthetic', which vLLM's RejectionSampler reads on CPU (HPU: rule
    # speculation_on_hpu refuses it); vLLM refuses these two without it
    "synthetic_acceptance_rates": "vLLM's RejectionSampler (synthetic mode)",
    "synthetic_acceptance_length": "resolved by vLLM into synthetic_acceptance_rates",
}

# Keys vLLM 0.30.0's SpeculativeConfig itself refuses with method dflash (its own error names them).
VLLM_REFUSES = {
    "tensor_parallel_size": "always refused: vLLM asks for draft_tensor_parallel_size",
    "use_heterogeneous_vocab": "method 'draft_model' only",
    "index_share_for_mtp_iteration": "method 'mtp' only",
    "dspark_draft_topk": "method 'dspark' only",
}

# Set by the engine when it builds the config (EngineArgs.create_speculative_config, __post_init__).
ENGINE_SET = ("target_model_config", "target_parallel_config", "draft_model_config", "draft_parallel_config")


@dataclass(frozen=True)
class Option:
    key: str
    default: Any                # vLLM 0.30.0's default
    refused_on: tuple[str, ...]  # devices on which the DFlash2 path does not honour another value
    why: str                    # what the path does instead
    supported: str              # what a launch may set
    # values that mean what the path does, besides the default (e.g. "auto"), given the launch's arguments
    also_accepted: Callable[[Callable[[str], Any]], tuple] = field(default=lambda arg: ())


def _target_tp(arg: Callable[[str], Any]) -> tuple:
    return (arg("tensor_parallel_size") or 1,)


_SUFFIX = "suffix decoding's tree; the DFlash2 path never builds one"

OPTIONS = [
    Option("rejection_sample_method", "standard", BOTH,
           "'block' verification exists only in vLLM's V2 runner; vLLM-CPU's V1 runner and vllm-gaudi verify "
           "one draft at a time",
           "'standard' (the default); 'synthetic' on CPU (cpu-rejection-sampler)",
           also_accepted=lambda arg: ("synthetic",)),
    Option("quantization", None, BOTH,
           "the DFlash2 drafter builds its linears without a quantization method: the weights load as stored",
           "no value (an unquantised drafter)"),
    Option("moe_backend", None, BOTH, "the DFlash2 drafter has no MoE layer", "no value"),
    Option("attention_backend", None, BOTH,
           "the DFlash2 drafter has no vLLM attention layer: its block attends in plain torch over the proposer's "
           "context", "no value or 'auto'", also_accepted=lambda arg: ("auto", "AUTO")),
    Option("kv_cache_dtype", None, BOTH,
           "the drafter's context K/V lives in the proposer (CPU: per request; Gaudi: its ring) in the drafter's "
           "dtype, outside vLLM's KV cache", "no value or 'auto'", also_accepted=lambda arg: ("auto",)),
    Option("draft_tensor_parallel_size", None, BOTH,
           "the drafter's layers shard over the target's tensor-parallel group", "the target's --tensor-parallel-size",
           also_accepted=_target_tp),
    Option("use_local_argmax_reduction", False, BOTH,
           "EAGLE's greedy draft sampling reads it; the DFlash2 walk takes the top-k of the full logits", "false"),
    Option("enable_adaptive_verification", False, BOTH,
           "adaptive verification is method dspark's, in vLLM's V2 runner", "false"),
    Option("prompt_lookup_max", None, BOTH, "an ngram option: vLLM sets it to 0 for method dflash", "no value"),
    Option("prompt_lookup_min", None, BOTH, "an ngram option: vLLM sets it to 0 for method dflash", "no value"),
    Option("suffix_decoding_max_tree_depth", 24, BOTH, _SUFFIX, "no value"),
    Option("suffix_decoding_max_cached_requests", 10000, BOTH, _SUFFIX, "no value"),
    Option("suffix_decoding_max_spec_factor", 1.0, BOTH, _SUFFIX, "no value"),
    Option("suffix_decoding_min_token_prob", 0.1, BOTH, _SUFFIX, "no value"),
    # Honoured on CPU by vLLM's V1 runner, which drives CpuDFlash2Proposer; vllm-gaudi's runner reads
    # none of these (of the speculative config it reads method, num_speculative_tokens, use_eagle()
    # and the draft model config only).
    Option("enforce_eager", None, HPU,
           "the Gaudi proposer captures its decode step in HPU graphs whenever the bridge runs lazy, whatever "
           "this says (on CPU no drafter graph exists)", "no value"),
    Option("max_model_len", None, HPU,
           "vllm-gaudi's runner drafts up to the target's --max-model-len (vLLM's V1 runner, on CPU, stops "
           "drafting at this one)", "no value (the target's --max-model-len)"),
    Option("disable_padded_drafter_batch", False, HPU,
           "vllm-gaudi hands the drafter its own padded verify layout always (vLLM's V1 runner, on CPU, "
           "switches to its unpadded inputs)", "false"),
    Option("num_speculative_tokens_per_batch_size", None, HPU,
           "the Gaudi proposer drafts num_speculative_tokens every step, its graphs captured for that count "
           "(on CPU the proposer drafts the count vLLM's scheduler picks)", "no value"),
]


def options_by_key() -> dict[str, Option]:
    return {o.key: o for o in OPTIONS}
