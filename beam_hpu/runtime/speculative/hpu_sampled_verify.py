"""A Gaudi speculative verify step with sampled requests (port unit `beam-sampled-verify`).

Why: vllm-gaudi's `hpu_rejection_sampler.py` swaps vLLM's `rejection_sample` for a greedy-only
one (`assert sampling_metadata.all_greedy`), and what vLLM's `RejectionSampler.forward` does
around it does not fit the HPU step either:
- vllm-gaudi lays a verify step out padded: sequence b's draft slots are b*k .. b*k+k-1 whatever
  its own draft count (`_prepare_spec_decode_inputs`; a padding slot's target index is -1, its
  draft id token_ids[0]), while vLLM expands per-request parameters over the flattened drafts
  (`cu_num_draft_tokens`), through a Triton kernel (`expand_batch_to_tokens`);
- vllm-gaudi marks a greedy request with temperature -1.0 (hpu_input_batch.py), vLLM with 0:
  vLLM's verifier would take those rows for random ones and divide their logits by -1;
- the runner pads the step's sampling metadata to its logits rows (B * (k+1)), one row per
  sequence is what the bonus sampler and the verifier read (the unit's runner edit pads to B).

So, for a batch with sampled rows, in plain torch:
1. bonus tokens from the runner's own Sampler (temperature, top-k/top-p, seeded generators);
2. the real draft slots only (`real_draft_slots`), i.e. vLLM's flattened layout;
3. their target logits processed as vLLM processes drafts' targets: temperature per request
   (1 for greedy rows), top-k/top-p by vLLM's own `apply_top_k_top_p` (`constrain_targets`);
4. uniforms in the stream of vLLM's `generate_uniform_probs` (a seeded request draws from its
   own generator; `uniform_draws` lets it draw on its own device, the host on Gaudi with the fix
   seeded-sampling) and `beam_hpu.runtime.speculative.rejection_sampling.verify`, the function the CPU
   path calls.
An all-greedy batch goes to the stock verifier unchanged.

What this step cannot do is refused per request before it gets here (`unverifiable_fields`, HTTP
400 through the runtime patch `hpu-speculative-sampling-limits`): penalties, bad words, allowed
token ids, min_tokens and logprobs. vLLM itself refuses min_p and logit_bias with speculation.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from beam_hpu.scope import is_beam_model_type
from beam_hpu.runtime.speculative.rejection_sampling import expand_per_request, uniform_draws, verify

# vLLM's Sampler and vllm-gaudi's input batch: temperature below this is a greedy request (-1.0
# on HPU, 0.0 in vLLM's GPU batch).
SAMPLING_EPS = 1e-5


def real_draft_slots(num_draft_tokens: list[int], width: int, device=None) -> torch.Tensor:
    """[T] the positions of real drafts in vllm-gaudi's padded layout (sequence b at b*width)."""
    counts = torch.tensor(num_draft_tokens, dtype=torch.long)
    if (counts > width).any():
        raise ValueError(f"a sequence has more drafts ({int(counts.max())}) than the verify step's "
                         f"{width} slots per sequence")
    starts = torch.repeat_interleave(torch.arange(len(num_draft_tokens)) * width, counts)
    ends = counts.cumsum(0)
    within = torch.arange(int(ends[-1]) if len(ends) else 0) - torch.repeat_interleave(ends - counts, counts)
    return (starts + within).to(device)


def greedy_rows(temperature: torch.Tensor) -> torch.Tensor:
    return temperature < SAMPLING_EPS


def constrain_targets(target_logits: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                      temperature: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """[T, V] target logits of the flattened drafts with each request's temperature (1 for greedy
    rows, whose argmax it keeps), then top-k/top-p as vLLM's sampler applies them. In place."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    num_tokens = target_logits.shape[0]
    scale = torch.where(greedy_rows(temperature), torch.ones_like(temperature), temperature)
    target_logits.div_(expand_per_request(scale, cu_num_draft_tokens, num_tokens)[:, None])
    expand = (lambda values: None if values is None
              else expand_per_request(values, cu_num_draft_tokens, num_tokens))
    return apply_top_k_top_p(target_logits, expand(top_k), expand(top_p))


def _unsupported_in_metadata(sampling_metadata) -> list[str]:
    found = []
    if not sampling_metadata.no_penalties:
        found.append("presence/frequency/repetition penalties")
    if sampling_metadata.bad_words_token_ids:
        found.append("bad_words")
    if sampling_metadata.allowed_token_ids_mask is not None:
        found.append("allowed_token_ids")
    return found


def verify_step(rejection_sampler, metadata, logits: torch.Tensor, sampling_metadata):
    """The SamplerOutput of a verify step: the stock verifier for an all-greedy batch, else the
    steps above. `rejection_sampler` is the runner's (vLLM's RejectionSampler, whose `sampler`
    draws the bonus tokens), `metadata` the step's SpecDecodeMetadata in vllm-gaudi's layout."""
    if sampling_metadata.all_greedy:
        return rejection_sampler(metadata, None, logits, sampling_metadata)
    from vllm.v1.outputs import SamplerOutput

    unsupported = _unsupported_in_metadata(sampling_metadata)
    if unsupported:  # unverifiable_fields refuses these requests; reaching here is a bug of ours
        raise ValueError(f"beam-sampled-verify: {', '.join(unsupported)} under speculation on HPU "
                         "are refused per request (beam_hpu.runtime.speculative.hpu_sampled_verify.unverifiable_fields)")
    num_draft_tokens = list(metadata.num_draft_tokens)
    batch = len(num_draft_tokens)
    width = metadata.draft_token_ids.numel() // batch
    rows = replace(
        sampling_metadata, max_num_logprobs=None,
        temperature=sampling_metadata.temperature[:batch],
        top_k=None if sampling_metadata.top_k is None else sampling_metadata.top_k[:batch],
        top_p=None if sampling_metadata.top_p is None else sampling_metadata.top_p[:batch],
        generators={i: g for i, g in sampling_metadata.generators.items() if i < batch},
        output_token_ids=sampling_metadata.output_token_ids[:batch])
    bonus = rejection_sampler.sampler(logits=logits[metadata.bonus_logits_indices], sampling_metadata=rows,
                                      predict_bonus_token=True).sampled_token_ids
    device = logits.device
    slots = real_draft_slots(num_draft_tokens, width, device)
    draft_token_ids = metadata.draft_token_ids.reshape(-1)[slots].contiguous()
    target_logits = logits[metadata.target_logits_indices[slots]].to(torch.float32)
    cu_num_draft_tokens = metadata.cu_num_draft_tokens.to(device)
    target_logits = constrain_targets(target_logits, cu_num_draft_tokens, rows.temperature, rows.top_k, rows.top_p)
    uniform = uniform_draws(draft_token_ids.shape[0], num_draft_tokens, rows.generators, device)
    greedy = greedy_rows(rows.temperature)
    output = verify(draft_token_ids, num_draft_tokens, width, cu_num_draft_tokens, None, target_logits,
                    bonus.reshape(-1, 1).contiguous(), all_greedy=False, all_random=not bool(greedy.any()),
                    temperature=torch.where(greedy, torch.zeros_like(rows.temperature), rows.temperature),
                    generators=rows.generators, uniform_probs=uniform,
                    noise_dtype=torch.float64 if getattr(rejection_sampler, "use_fp64_gumbel", False)
                    else torch.float32)
    return SamplerOutput(sampled_token_ids=output, logprobs_tensors=None)


# ------------------------------------------------------------ what a request may not ask for here

def unverifiable_fields(params: Any) -> list[tuple[str, str]]:
    """(request field, why) for each sampling feature a Beam verify step on HPU cannot serve;
    `params` is vLLM's SamplingParams (read by attribute only). Empty when it may be served."""
    found = []
    why_penalty = ("vllm-gaudi's sampling metadata has no spec_token_ids and its verify layout is padded, "
                   "so vLLM's penalties over drafts would count the wrong tokens or fail on shape")
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        if getattr(params, name, neutral) != neutral:
            found.append((name, why_penalty))
    if getattr(params, "bad_words", None):
        found.append(("bad_words", "vLLM bans bad words over drafts from the drafts' tokens, which "
                                   "vllm-gaudi's sampling metadata does not carry"))
    if getattr(params, "allowed_token_ids", None):
        found.append(("allowed_token_ids", "the verify step does not mask drafts' targets with the "
                                           "allowed-token mask"))
    if (getattr(params, "min_tokens", 0) or 0) > 0:
        found.append(("min_tokens", "the verify step does not apply min_tokens to drafts' targets"))
    if getattr(params, "logprobs", None) is not None:
        found.append(("logprobs", "vllm-gaudi's runner returns no logprobs for a verify step's tokens"))
    return found


def request_refusal(params: Any, *, model_type: str | None, speculative: bool,
                    device_type: str) -> tuple[str, str] | None:
    """(field, message) of an HTTP 400 for a request this port's HPU verify step cannot serve, or
    None. Acts only for a Beam model on HPU with --speculative-config: on CPU vLLM's own verifier
    (through cpu-rejection-sampler) serves every field, and without drafts nothing is verified."""
    if not speculative or device_type != "hpu" or not is_beam_model_type(model_type):
        return None
    found = unverifiable_fields(params)
    if not found:
        return None
    field, why = found[0]
    names = ", ".join(name for name, _ in found)
    return field, (f"{names} cannot be served with speculative decoding on Gaudi: {why} "
                   "(beam_hpu.runtime.speculative.hpu_sampled_verify); drop the field or serve without --speculative-config")
