"""Verification of drafted tokens (speculative decoding) in plain torch, for both platforms.

Why a room of its own (`beam_hpu/speculative/`): the same functions verify drafts on vLLM-CPU
and on Gaudi, so speculative sampling has one definition, tested once.
- CPU: vLLM 0.30.0's `vllm/v1/sample/rejection_sampler.py` runs its four steps (greedy accept,
  random accept, per-token expansion, recovered tokens) through JIT-warmup Triton dispatchers
  that vLLM-CPU cannot launch; the runtime patch `cpu-rejection-sampler`
  (beam_hpu/runtime/speculative/patch_cpu_rejection_sampler.py) routes `rejection_sample` and
  `expand_batch_to_tokens` here.
- HPU: vllm-gaudi's verifier is greedy only (`assert sampling_metadata.all_greedy`); the port
  unit `beam-sampled-verify` sends a Beam verify step with sampled rows through
  `beam_hpu.runtime.speculative.hpu_sampled_verify`, which calls `verify` here.
Every tensor is made on the device of the inputs (and a seeded request's generator draws on its
own device), so the functions run where the logits are.

The algorithm (Leviathan et al. 2023, speculative sampling), per request with drafts d_1..d_n:
- greedy request: accept d_i while d_i equals the target argmax at i; at the first mismatch emit
  the target argmax there and stop; if all n are accepted emit the bonus token as well.
- random request: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)) (q_i is the draft's
  distribution; a drafter that gives none, like ngram, is a point mass: q_i(d_i) = 1); at the first
  rejection emit a token drawn from norm(max(p_i - q_i, 0)) and stop; all accepted: the bonus.
- a draft id below 0 (padding) is always rejected.
Emitted tokens are thereby distributed as the target's p; greedy output equals plain decoding.

Layout (vLLM's): drafts of all requests flattened into [T] with `cu_num_draft_tokens` [B] the
running end of each request's span; output [B, max_spec_len + 1] int32, unused slots PLACEHOLDER.
"""

from __future__ import annotations

import torch

PLACEHOLDER = -1


def _spans(cu_num_draft_tokens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request index [T], position within its request [T]) of every flattened draft token."""
    ends = cu_num_draft_tokens.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    request = torch.repeat_interleave(torch.arange(len(ends), device=ends.device), counts, output_size=num_tokens)
    position = torch.arange(num_tokens, device=ends.device) - (ends - counts)[request]
    return request, position


def _padded(values: torch.Tensor, request: torch.Tensor, position: torch.Tensor, batch: int,
            width: int, fill) -> torch.Tensor:
    out = torch.full((batch, width), fill, dtype=values.dtype, device=values.device)
    out[request, position] = values
    return out


def _write(output: torch.Tensor, rows: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
           draft_token_ids: torch.Tensor, accepted: torch.Tensor, fallback: torch.Tensor,
           bonus_token_ids: torch.Tensor) -> None:
    """Fill output rows `rows` (bool [B]): the accepted prefix of drafts, then the fallback token
    at the first rejected position, or the bonus token when every draft was accepted."""
    batch, width = output.shape[0], output.shape[1] - 1
    num_tokens = draft_token_ids.shape[0]
    request, position = _spans(cu_num_draft_tokens, num_tokens)
    counts = torch.diff(cu_num_draft_tokens.long(), prepend=cu_num_draft_tokens.new_zeros(1).long())
    drafts = _padded(draft_token_ids.long(), request, position, batch, width, PLACEHOLDER)
    ok = _padded(accepted, request, position, batch, width, False)
    fall = _padded(fallback.long(), request, position, batch, width, PLACEHOLDER)
    num_accepted = torch.cumprod(ok.long(), dim=1).sum(dim=1)  # length of the accepted prefix
    device = output.device
    slots = torch.arange(width + 1, device=device)
    row = torch.full((batch, width + 1), PLACEHOLDER, dtype=torch.long, device=device)
    row[:, :width] = torch.where(slots[:width] < num_accepted[:, None], drafts, PLACEHOLDER)
    stop = bonus_token_ids.reshape(-1).long().clone()
    rejected = torch.nonzero(num_accepted < counts)[:, 0]
    stop[rejected] = fall[rejected, num_accepted[rejected]]
    row[torch.arange(batch, device=device), num_accepted] = stop
    output[rows] = row[rows].to(output.dtype)


def greedy_verify(output: torch.Tensor, cu_num_draft_tokens: torch.Tensor, draft_token_ids: torch.Tensor,
                  target_argmax: torch.Tensor, bonus_token_ids: torch.Tensor,
                  is_greedy: torch.Tensor | None, uniform_probs: torch.Tensor | None = None,
                  synthetic_conditional_rates: torch.Tensor | None = None) -> None:
    """Greedy rows (all when is_greedy is None) of `output`, in place.

    Synthetic mode (vLLM's benchmark aid, `rejection_sample_method="synthetic"`): a draft is
    accepted with the given conditional rate at its position instead of by comparison."""
    if synthetic_conditional_rates is not None:
        _, position = _spans(cu_num_draft_tokens, draft_token_ids.shape[0])
        accepted = (uniform_probs < synthetic_conditional_rates[position]) & (draft_token_ids >= 0)
    else:
        accepted = draft_token_ids.long() == target_argmax.long()
    all_rows = torch.ones(output.shape[0], dtype=torch.bool, device=output.device)
    rows = all_rows if is_greedy is None else is_greedy.bool()
    _write(output, rows, cu_num_draft_tokens, draft_token_ids, accepted, target_argmax, bonus_token_ids)


def random_accepts(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                   target_probs: torch.Tensor, uniform_probs: torch.Tensor) -> torch.Tensor:
    """Bool [T]: u <= min(1, p(d) / q(d)) for each draft d (q = 1 without draft probs; q(d) = 0
    or a padded d < 0 rejects). p(d) = 0 always rejects, even for u == 0: a token a grammar masked
    to -inf is accepted with probability 0, not 2^-53."""
    valid = draft_token_ids >= 0
    index = draft_token_ids.long().clamp(min=0)[:, None]
    p = target_probs.gather(1, index)[:, 0].double()
    q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(1, index)[:, 0].double()
    return valid & (q > 0) & (p > 0) & (p >= uniform_probs.double() * q)


def random_verify(output: torch.Tensor, cu_num_draft_tokens: torch.Tensor, draft_token_ids: torch.Tensor,
                  draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                  bonus_token_ids: torch.Tensor, recovered_token_ids: torch.Tensor,
                  uniform_probs: torch.Tensor, is_greedy: torch.Tensor | None,
                  synthetic_conditional_rates: torch.Tensor | None = None) -> None:
    """Random-sampling rows (is_greedy False; all when None) of `output`, in place."""
    if synthetic_conditional_rates is not None:
        _, position = _spans(cu_num_draft_tokens, draft_token_ids.shape[0])
        accepted = (uniform_probs < synthetic_conditional_rates[position]) & (draft_token_ids >= 0)
    else:
        accepted = random_accepts(draft_token_ids, draft_probs, target_probs, uniform_probs)
    all_rows = torch.ones(output.shape[0], dtype=torch.bool, device=output.device)
    rows = all_rows if is_greedy is None else ~is_greedy.bool()
    _write(output, rows, cu_num_draft_tokens, draft_token_ids, accepted, recovered_token_ids,
           bonus_token_ids)


def residual(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
             target_probs: torch.Tensor) -> torch.Tensor:
    """[T, V] unnormalised max(p - q, 0); without draft probs q is the point mass at the draft."""
    if draft_probs is not None:
        return (target_probs - draft_probs).clamp(min=0)
    out = target_probs.clone()
    drafted = torch.nonzero(draft_token_ids >= 0)[:, 0]
    out[drafted, draft_token_ids[drafted].long()] = 0
    return out


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


def recovered_tokens(cu_num_draft_tokens: torch.Tensor, draft_token_ids: torch.Tensor,
                     draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     noise: torch.Tensor) -> torch.Tensor:
    """[T] a draw from norm(max(p - q, 0)) at every draft position: argmax of weight / E with E
    ~ Exp(1) picks index i with probability weight_i / sum(weight) (the exponential race). One
    noise row per request is enough: only a request's first rejected position uses its draw."""
    request, _ = _spans(cu_num_draft_tokens, draft_token_ids.shape[0])
    weights = residual(draft_token_ids, draft_probs, target_probs)
    return (weights.to(noise.dtype) / noise[request]).argmax(dim=-1).to(draft_token_ids.dtype)


def expand_per_request(values: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                       replace_from=0, replace_to=0) -> torch.Tensor:
    """[B] -> [num_tokens]: each request's value repeated over its tokens, with replace_from
    replaced by replace_to (vLLM's `expand_batch_to_tokens`: temperature 0 becomes 1 there)."""
    ends = cu_num_tokens.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    swapped = torch.where(values == replace_from,
                          torch.as_tensor(replace_to, dtype=values.dtype, device=values.device), values)
    return torch.repeat_interleave(swapped, counts, output_size=num_tokens)


def verify(draft_token_ids: torch.Tensor, num_draft_tokens: list[int], max_spec_len: int,
           cu_num_draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
           target_logits: torch.Tensor, bonus_token_ids: torch.Tensor, *, all_greedy: bool,
           all_random: bool, temperature: torch.Tensor | None, generators: dict[int, torch.Generator],
           uniform_probs: torch.Tensor | None, synthetic_conditional_rates: torch.Tensor | None = None,
           noise_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole verify step: [B, max_spec_len + 1] int32 emitted tokens, PLACEHOLDER elsewhere.

    `target_logits` [T, V] are the target's processed logits at the draft positions (temperature,
    top-k/top-p already applied for random rows); `uniform_probs` [T] float64 are needed unless
    every request is greedy and synthetic mode is off."""
    output = torch.full((len(num_draft_tokens), max_spec_len + 1), PLACEHOLDER, dtype=torch.int32,
                        device=target_logits.device)
    is_greedy = None if all_greedy else temperature == 0
    if not all_random:
        greedy_verify(output, cu_num_draft_tokens, draft_token_ids, target_logits.argmax(dim=-1),
                      bonus_token_ids, is_greedy, uniform_probs, synthetic_conditional_rates)
        if all_greedy:
            return output
    target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)
    noise = recovery_noise(num_draft_tokens, target_probs.shape[-1], generators, noise_dtype, target_probs.device)
    recovered = recovered_tokens(cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, noise)
    random_verify(output, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                  bonus_token_ids, recovered, uniform_probs, is_greedy, synthetic_conditional_rates)
    return output
