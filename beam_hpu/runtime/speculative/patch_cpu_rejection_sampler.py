"""Runtime patch `cpu-rejection-sampler`: vLLM-CPU verifies drafted tokens (speculative decoding)
through `beam_hpu.runtime.speculative.rejection_sampling` instead of Triton kernels it cannot launch. CPU only."""

from __future__ import annotations

import inspect
import logging

import torch

from beam_hpu.runtime.wrap import wrap

NAME = "cpu-rejection-sampler"
logger = logging.getLogger("vllm." + __name__)  # vLLM's handler prints it in the engine's log


def _rejection_sample_on_cpu(stock_rejection_sample):
    from beam_hpu.runtime.speculative.rejection_sampling import verify
    from vllm.v1.sample import rejection_sampler

    signature = inspect.signature(stock_rejection_sample)
    told: list[bool] = []  # the first step with draft probabilities is logged

    def rejection_sample(*args, **kwargs):
        a = signature.bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        metadata = a["sampling_metadata"]
        uniform = None
        if a["synthetic_mode"] or not metadata.all_greedy:
            # vLLM's own draw (plain torch): seeded requests keep vLLM's stream of uniforms.
            uniform = rejection_sampler.generate_uniform_probs(
                a["draft_token_ids"].shape[0], a["num_draft_tokens"], metadata.generators,
                a["target_logits"].device)
        if a["draft_probs"] is not None and not told:
            told.append(True)
            logger.info("%s: verifying drafts against the distributions they were drawn from", NAME)
        return verify(a["draft_token_ids"], a["num_draft_tokens"], a["max_spec_len"],
                      a["cu_num_draft_tokens"], a["draft_probs"], a["target_logits"],
                      a["bonus_token_ids"], all_greedy=metadata.all_greedy,
                      all_random=metadata.all_random, temperature=metadata.temperature,
                      generators=metadata.generators, uniform_probs=uniform,
                      synthetic_conditional_rates=a["synthetic_conditional_rates"],
                      noise_dtype=torch.float64 if a["use_fp64_gumbel"] else torch.float32)

    return rejection_sample


def _expand_on_cpu(stock_expand):
    from beam_hpu.runtime.speculative.rejection_sampling import expand_per_request

    signature = inspect.signature(stock_expand)

    def expand_batch_to_tokens(*args, **kwargs):
        a = signature.bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        return expand_per_request(a["x"], a["cu_num_tokens"], a["num_tokens"], a["replace_from"],
                                  a["replace_to"])

    return expand_batch_to_tokens


def install() -> None:
    from vllm.v1.sample import rejection_sampler

    wrap(rejection_sampler, "rejection_sample", _rejection_sample_on_cpu, patch=NAME)
    wrap(rejection_sampler, "expand_batch_to_tokens", _expand_on_cpu, patch=NAME)
