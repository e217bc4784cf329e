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
  sequence is what the bonus sampler and the verifier read (the unit's runner edit pads to B);
- flattening the real drafts on the device (`nonzero`, boolean masks, index tensors as long as
  the step's number of drafts) gives every step a shape of its own: under HPU graphs and lazy
  mode each new draft count compiles again, and each read-back stalls the step.

So, for a batch with sampled rows (`verify_drafts`), with device shapes of (B, k, V) only:
1. bonus tokens from the runner's own Sampler (temperature, top-k/top-p, seeded generators);
2. the target logits of all B * k slots, padding included (`metadata.target_logits_indices`,
   padding's -1 read as row 0), processed as vLLM processes drafts' targets: temperature per
   request (1 for greedy rows), top-k/top-p by vLLM's sort-based `apply_top_k_top_p_pytorch`,
   which never reads a value back (`constrain_targets`);
3. uniforms in the stream of vLLM's `generate_uniform_probs`, drawn on the host (a seeded
   request from its own generator, which the fix seeded-sampling keeps on the host), laid out
   [B, k] there and moved once; the counts move as one [B] tensor;
4. `beam_hpu.runtime.speculative.rejection_sampling.verify_padded`, the function the CPU path
   calls too.
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
from beam_hpu.runtime.speculative.rejection_sampling import padded_index, recovery_noise, uniform_draws, verify_padded

# vLLM's Sampler and vllm-gaudi's input batch: temperature below this is a greedy request (-1.0
# on HPU, 0.0 in vLLM's GPU batch).
SAMPLING_EPS = 1e-5


def greedy_rows(temperature: torch.Tensor) -> torch.Tensor:
    return temperature < SAMPLING_EPS


def constrain_targets(target_logits: torch.Tensor, width: int, temperature: torch.Tensor,
                      top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """[B * width, V] target logits of the padded slots with each request's temperature (1 for
    greedy rows, whose argmax it keeps), then top-k/top-p as vLLM's sampler applies them. In place.
    The sort-based form: vLLM's `apply_top_k_top_p` would take a top-k-only path on some platforms
    whose shape follows the largest k (read back from the device)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    def per_slot(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else values.unsqueeze(1).expand(-1, width).reshape(-1)

    scale = torch.where(greedy_rows(temperature), torch.ones_like(temperature), temperature)
    target_logits.div_(per_slot(scale).unsqueeze(1))
    return apply_top_k_top_p_pytorch(target_logits, per_slot(top_k), per_slot(top_p), allow_cpu_sync=False)


def padded_uniforms(num_draft_tokens: list[int], width: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """[B, width] float32 host uniforms: vLLM's stream (`uniform_draws`, on the host) in the
    padded layout. float32 because Gaudi has no float64 arithmetic worth the name; the accept
    test p(d) >= u moves by at most 2^-24."""
    flat = uniform_draws(sum(num_draft_tokens), num_draft_tokens, generators, "cpu")
    if flat.numel() == 0:
        flat = flat.new_zeros(1)
    return flat[padded_index(num_draft_tokens, width)].reshape(len(num_draft_tokens), width).to(torch.float32)


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
    """The SamplerOutput of a verify step: the stock verifier for an all-greedy batch, else
    `verify_drafts`. `rejection_sampler` is the runner's (vLLM's RejectionSampler, whose `sampler`
    draws the bonus tokens), `metadata` the step's SpecDecodeMetadata in vllm-gaudi's layout."""
    if sampling_metadata.all_greedy:
        return rejection_sampler(metadata, None, logits, sampling_metadata)
    from vllm.v1.outputs import SamplerOutput

    unsupported = _unsupported_in_metadata(sampling_metadata)
    if unsupported:  # unverifiable_fields refuses these requests; reaching here is a bug of ours
        raise ValueError(f"beam-sampled-verify: {', '.join(unsupported)} under speculation on HPU "
                         "are refused per request (beam_hpu.runtime.speculative.hpu_sampled_verify.unverifiable_fields)")
    batch = len(metadata.num_draft_tokens)
    rows = replace(
        sampling_metadata, max_num_logprobs=None,
        temperature=sampling_metadata.temperature[:batch],
        top_k=None if sampling_metadata.top_k is None else sampling_metadata.top_k[:batch],
        top_p=None if sampling_metadata.top_p is None else sampling_metadata.top_p[:batch],
        generators={i: g for i, g in sampling_metadata.generators.items() if i < batch},
        output_token_ids=sampling_metadata.output_token_ids[:batch])
    bonus = rejection_sampler.sampler(logits=logits[metadata.bonus_logits_indices], sampling_metadata=rows,
                                      predict_bonus_token=True).sampled_token_ids
    return SamplerOutput(sampled_token_ids=verify_drafts(metadata, logits, rows, bonus), logprobs_tensors=None)


def verify_drafts(metadata, logits: torch.Tensor, rows, bonus_token_ids: torch.Tensor) -> torch.Tensor:
    """[B, k + 1] int32 emitted tokens of a verify step in vllm-gaudi's padded layout: `metadata`
    its SpecDecodeMetadata (draft_token_ids and target_logits_indices [B * k] on the device,
    num_draft_tokens a host list), `rows` its sampling metadata with one row per sequence,
    `bonus_token_ids` [B] or [B, 1]. Device tensors have shapes of (B, k, V) only; what depends
    on the draft counts is made on the host."""
    num_draft_tokens = [int(n) for n in metadata.num_draft_tokens]
    batch = len(num_draft_tokens)
    width = metadata.draft_token_ids.numel() // batch
    device = logits.device
    # padding slots' target index is -1: read row 0 instead (masked later), no negative indexing
    target_logits = logits.index_select(0, metadata.target_logits_indices.clamp(min=0)).to(torch.float32)
    target_logits = constrain_targets(target_logits, width, rows.temperature, rows.top_k, rows.top_p)
    counts = torch.tensor(num_draft_tokens, dtype=torch.int32).to(device)
    uniform = padded_uniforms(num_draft_tokens, width, rows.generators).to(device)
    noise = recovery_noise(num_draft_tokens, logits.shape[-1], rows.generators, torch.float32, device)
    return verify_padded(metadata.draft_token_ids.reshape(batch, width), counts, target_logits, bonus_token_ids,
                         greedy=greedy_rows(rows.temperature), uniform_probs=uniform, noise=noise)


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
