"""Verification of drafted tokens (speculative decoding) in plain torch, for both platforms.

Why a room of its own: the same function verifies drafts on vLLM-CPU and on Gaudi, so speculative
sampling has one definition, tested once.
- HPU: vllm-gaudi's verifier is greedy only (`assert sampling_metadata.all_greedy`); the port
  unit `beam-sampled-verify` sends a Beam verify step with sampled rows through
  `beam_hpu.runtime.speculative.hpu_sampled_verify`, which calls `verify_padded` here.
- CPU: vLLM 0.30.0's `vllm/v1/sample/rejection_sampler.py` runs its four steps (greedy accept,
  random accept, per-token expansion, recovered tokens) through JIT-warmup Triton dispatchers
  that vLLM-CPU cannot launch; the runtime patch `cpu-rejection-sampler`
  (beam_hpu/runtime/speculative/patch_cpu_rejection_sampler.py) routes `rejection_sample` to
  `verify` (vLLM's flattened layout, padded on the host, then `verify_padded`) and
  `expand_batch_to_tokens` to `expand_per_request`.

The algorithm (Leviathan et al. 2023, speculative sampling), per request with drafts d_1..d_n:
- greedy request: accept d_i while d_i equals the target argmax at i; at the first mismatch emit
  the target argmax there and stop; if all n are accepted emit the bonus token as well.
- random request: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)) (q_i is the draft's
  distribution; a drafter that gives none, like ngram, is a point mass: q_i(d_i) = 1); at the first
  rejection emit a token drawn from norm(max(p_i - q_i, 0)) and stop; all accepted: the bonus.
- a draft id below 0 (padding) is always rejected.
Emitted tokens are thereby distributed as the target's p; greedy output equals plain decoding.

Padded layout (vllm-gaudi's): request b's draft slots are b*k .. b*k+k-1 whatever its own count
n_b; slots past n_b hold anything and are masked. Every tensor `verify_padded` makes has a shape
of (B, k, V) only, and it reads no value back to the host: under HPU graphs a shape that followed
the draft counts would compile a graph per count, and a read-back would stall each step. What
depends on the counts (which slots are real, where each seeded request's uniforms go) is computed
on the host from the host list of counts. Output [B, k + 1] int32, PLACEHOLDER after the emitted
tokens (vLLM's PLACEHOLDER_TOKEN_ID).
"""

from __future__ import annotations

import torch

PLACEHOLDER = -1


def padded_index(num_draft_tokens: list[int], width: int) -> torch.Tensor:
    """[B * width] host int64: the flattened position (vLLM's layout) of the draft in each padded
    slot; padding slots point at 0 (any real position: their values are masked)."""
    if any(n > width for n in num_draft_tokens):
        raise ValueError(f"a sequence has more drafts ({max(num_draft_tokens)}) than the verify step's "
                         f"{width} slots per sequence")
    index, start = [], 0
    for n in num_draft_tokens:
        index += list(range(start, start + n)) + [0] * (width - n)
        start += n
    return torch.tensor(index, dtype=torch.int64)


def _at_drafts(values: torch.Tensor, draft_token_ids: torch.Tensor) -> torch.Tensor:
    """values[..., d] for each draft d (a draft below 0 reads token 0; callers mask it)."""
    return values.gather(-1, draft_token_ids.long().clamp(min=0).unsqueeze(-1)).squeeze(-1)


def random_accepts(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                   target_probs: torch.Tensor, uniform_probs: torch.Tensor) -> torch.Tensor:
    """Bool, the drafts' shape: u <= min(1, p(d) / q(d)) for each draft d (q = 1 without draft
    probs; q(d) = 0 or a padded d < 0 rejects), compared in the uniforms' dtype. p(d) = 0 always
    rejects, even for u == 0: a token a grammar masked to -inf is accepted with probability 0."""
    p = _at_drafts(target_probs, draft_token_ids).to(uniform_probs.dtype)
    q = torch.ones_like(p) if draft_probs is None else _at_drafts(draft_probs, draft_token_ids).to(p.dtype)
    return (draft_token_ids >= 0) & (q > 0) & (p > 0) & (p >= uniform_probs * q)


def residual(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
             target_probs: torch.Tensor) -> torch.Tensor:
    """[..., V] unnormalised max(p - q, 0); without draft probs q is the point mass at the draft
    (a draft below 0 has none: p unchanged)."""
    if draft_probs is not None:
        return (target_probs - draft_probs).clamp(min=0)
    index = draft_token_ids.long().clamp(min=0).unsqueeze(-1)
    kept = torch.where(draft_token_ids.unsqueeze(-1) >= 0, torch.zeros_like(target_probs[..., :1]),
                       target_probs.gather(-1, index))
    return target_probs.scatter(-1, index, kept)


def recovered_tokens(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """[B, k] a draw from norm(max(p - q, 0)) at every draft slot (probs [B, k, V]): argmax of
    weight / E with E ~ Exp(1) picks index i with probability weight_i / sum(weight) (the
    exponential race). One noise row [V] per request (noise [B, V]) is enough: only a request's
    first rejected slot uses its draw."""
    weights = residual(draft_token_ids, draft_probs, target_probs)
    return (weights.to(noise.dtype) / noise.unsqueeze(1)).argmax(dim=-1)


def recovery_noise(num_draft_tokens: list[int], vocab_size: int, generators: dict[int, torch.Generator],
                   dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, V] Exp(1) draws, one row per request (a request's seeded generator draws its own row,
    only when it has drafts, so its stream does not depend on steps without drafts). A generator
    on another device than the noise (on Gaudi the v0.30.0 fix seeded-sampling keeps them on the
    host) draws on its own device; the row is copied over."""
    noise = torch.empty((len(num_draft_tokens), vocab_size), dtype=dtype, device=device).exponential_()
    for index, generator in generators.items():
        if num_draft_tokens[index] > 0:
            noise[index].copy_(_own_device_draw(vocab_size, dtype, generator, "exponential_"))
    return noise


def _own_device_draw(size: int, dtype: torch.dtype, generator: torch.Generator, draw: str) -> torch.Tensor:
    out = torch.empty(size, dtype=dtype, device=generator.device)
    return getattr(out, draw)(generator=generator)


def uniform_draws(num_tokens: int, num_draft_tokens: list[int], generators: dict[int, torch.Generator],
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """[T] float64 uniforms in [0, 1), the stream of vLLM's `generate_uniform_probs` (an unseeded
    draw for all, then each seeded request's span redrawn from its generator, skipping requests
    without drafts), with each generator drawing on its own device: vLLM's draws on the output's
    device, which fails for the host generators Gaudi keeps (fix seeded-sampling)."""
    uniform = torch.rand((num_tokens,), dtype=torch.float64, device=device)
    start = 0
    for index, n in enumerate(num_draft_tokens):
        if n == 0:
            continue
        generator = generators.get(index)
        if generator is not None:
            uniform[start:start + n].copy_(_own_device_draw(n, torch.float64, generator, "uniform_"))
        start += n
    return uniform


def expand_per_request(values: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                       replace_from=0, replace_to=0) -> torch.Tensor:
    """[B] -> [num_tokens]: each request's value repeated over its tokens, with replace_from
    replaced by replace_to (vLLM's `expand_batch_to_tokens`: temperature 0 becomes 1 there)."""
    ends = cu_num_tokens.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    swapped = torch.where(values == replace_from,
                          torch.as_tensor(replace_to, dtype=values.dtype, device=values.device), values)
    return torch.repeat_interleave(swapped, counts, output_size=num_tokens)


def emitted_tokens(draft_token_ids: torch.Tensor, valid: torch.Tensor, accepted: torch.Tensor,
                   fallback: torch.Tensor, bonus_token_ids: torch.Tensor) -> torch.Tensor:
    """[B, k + 1] int32: each request's accepted prefix of drafts, then the fallback token at its
    first rejected slot, or its bonus token when every real draft was accepted; PLACEHOLDER after.
    `valid` [B, k] marks the real slots; `accepted` [B, k] is true at accepted real slots only."""
    batch, width = draft_token_ids.shape
    bonus = bonus_token_ids.reshape(batch).long()
    if width == 0:
        return bonus.unsqueeze(1).to(torch.int32)
    num_accepted = accepted.to(torch.float32).cumprod(dim=1).sum(dim=1).long()  # the accepted prefix
    count = valid.long().sum(dim=1)
    at_stop = fallback.long().gather(1, num_accepted.clamp(max=width - 1).unsqueeze(1)).squeeze(1)
    stop = torch.where(num_accepted == count, bonus, at_stop)
    slots = torch.arange(width + 1, device=draft_token_ids.device).unsqueeze(0)
    drafts = torch.cat([draft_token_ids.long(), torch.full_like(bonus, PLACEHOLDER).unsqueeze(1)], dim=1)
    placeholder = torch.full_like(drafts, PLACEHOLDER)
    end = num_accepted.unsqueeze(1)
    out = torch.where(slots < end, drafts, torch.where(slots == end, stop.unsqueeze(1), placeholder))
    return out.to(torch.int32)


def verify_padded(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                  bonus_token_ids: torch.Tensor, *, greedy: torch.Tensor | bool,
                  uniform_probs: torch.Tensor | None, noise: torch.Tensor | None,
                  draft_probs: torch.Tensor | None = None,
                  synthetic_conditional_rates: torch.Tensor | None = None) -> torch.Tensor:
    """The verify step in the padded layout: [B, k + 1] int32 emitted tokens.

    draft_token_ids [B, k]; num_draft_tokens [B] (a tensor on the logits' device: slot i of
    request b is real when i < n_b); target_logits [B * k, V] the target's processed logits at
    the slots (temperature, top-k/top-p applied for random rows); bonus_token_ids [B] or [B, 1];
    greedy [B] bool per request, or one bool for the whole batch; uniform_probs [B, k] (unless
    every request is greedy and synthetic mode is off); noise [B, V] Exp(1) (unless all greedy);
    draft_probs [B * k, V] or None (point-mass drafts). Synthetic mode (vLLM's benchmark aid):
    a draft is accepted with the given conditional rate at its slot instead of by the rule."""
    batch, width = draft_token_ids.shape
    vocab = target_logits.shape[-1]
    device = target_logits.device
    valid = torch.arange(width, device=device).unsqueeze(0) < num_draft_tokens.to(device).unsqueeze(1)
    target_argmax = target_logits.argmax(dim=-1).reshape(batch, width)
    if synthetic_conditional_rates is not None:
        chosen = (uniform_probs < synthetic_conditional_rates[:width].unsqueeze(0)) & (draft_token_ids >= 0)
        greedy_accepts = random_accepted = chosen
    else:
        greedy_accepts = draft_token_ids.long() == target_argmax
    if greedy is True:
        return emitted_tokens(draft_token_ids, valid, greedy_accepts & valid, target_argmax, bonus_token_ids)
    target_probs = target_logits.softmax(dim=-1, dtype=torch.float32).reshape(batch, width, vocab)
    q = None if draft_probs is None else draft_probs.reshape(batch, width, vocab)
    if synthetic_conditional_rates is None:
        random_accepted = random_accepts(draft_token_ids, q, target_probs, uniform_probs)
    recovered = recovered_tokens(draft_token_ids, q, target_probs, noise)
    if greedy is False:
        accepted, fallback = random_accepted, recovered
    else:
        accepted = torch.where(greedy.unsqueeze(1), greedy_accepts, random_accepted)
        fallback = torch.where(greedy.unsqueeze(1), target_argmax, recovered)
    return emitted_tokens(draft_token_ids, valid, accepted & valid, fallback, bonus_token_ids)


def verify(draft_token_ids: torch.Tensor, num_draft_tokens: list[int], max_spec_len: int,
           cu_num_draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
           target_logits: torch.Tensor, bonus_token_ids: torch.Tensor, *, all_greedy: bool,
           all_random: bool, temperature: torch.Tensor | None, generators: dict[int, torch.Generator],
           uniform_probs: torch.Tensor | None, synthetic_conditional_rates: torch.Tensor | None = None,
           noise_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`verify_padded` for vLLM's flattened layout (drafts of all requests in [T], target_logits
    [T, V] processed as vLLM processes them, uniform_probs [T]), as vLLM's `rejection_sample`
    takes it: the drafts are padded to [B, max_spec_len] slots on the host's index first.
    `cu_num_draft_tokens` is part of vLLM's signature; the host list of counts says the same."""
    device = target_logits.device
    index = padded_index(num_draft_tokens, max_spec_len).to(device)

    def padded(values: torch.Tensor | None) -> torch.Tensor | None:
        if values is None:
            return None
        if values.shape[0] == 0:  # no drafts at all: every slot is padding
            values = values.new_zeros((1, *values.shape[1:]))
        return values.index_select(0, index)

    batch = len(num_draft_tokens)
    greedy = True if all_greedy else False if all_random else temperature == 0
    uniform = padded(uniform_probs)
    noise = None if greedy is True else recovery_noise(num_draft_tokens, target_logits.shape[-1], generators,
                                                       noise_dtype, device)
    return verify_padded(
        padded(draft_token_ids).reshape(batch, max_spec_len),
        torch.tensor(num_draft_tokens, dtype=torch.int64, device=device), padded(target_logits),
        bonus_token_ids, greedy=greedy, uniform_probs=None if uniform is None else uniform.reshape(batch, max_spec_len),
        noise=noise, draft_probs=padded(draft_probs), synthetic_conditional_rates=synthetic_conditional_rates)
