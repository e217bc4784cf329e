"""A DFlash2 proposer for vLLM 0.30.0's V1 runner, for Beam's drafter (beam_hpu.model.dflash2).

vLLM 0.30.0 drafts DFlash2 only in its V2 GPU runner (Triton); its V1 runner, the one vLLM-CPU
runs, builds `DFlashProposer` (DFlash v1) for `"method": "dflash"`, which never runs the
candidate selector. This class is a `DFlashProposer` to the runner: it takes the runner's DFlash
branch unchanged (the target's auxiliary hidden states at dflash_config.target_layer_ids + 1,
`prepare_next_token_ids_padded` for the bonus tokens, `prepare_inputs_padded` for the rejected
rows, the k + 1 lookahead slots) and replaces what DFlash v1 does with them:

- context: the target's states at each request's accepted tokens become the drafter's context
  K/V (`combine_hidden_states`, `context_kv`), kept per request in `dflash2_context` (the Beam
  drafter has no attention layer in vLLM's KV cache, so nothing is written there);
- one block forward per step: the bonus token and k mask tokens at the positions after the last
  accepted token, non-causal, over that context;
- the candidate selector's walk over each drafted row's top-k: greedy (`draft_greedy`), or with
  `draft_sample_method: probabilistic` sampled at each request's temperature (`draft_sampled`), as
  upstream's walk draws it.

A request that starts past position 0 (its first blocks were a prefix-cache hit) takes back the
context rows of those blocks from `dflash2_prefix`, where the proposer keeps the rows of every
full block it has seen, so it drafts as a request that computed them (`tests/runtime/speculative/
test_dflash2_prefix.py`).

Greedy drafts go to verification as point masses (no draft probabilities). Sampled drafts go with
the distributions they were drawn from (vLLM's `take_last_draft_probs`, scattered over the
vocabulary), so vLLM's rejection sampling accepts each by p / q; either way sampled requests stay
exact in distribution. A batch of greedy requests only walks greedily, as vLLM's own drafters do.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from beam_hpu.model.dflash2 import DFlash2Context, drafter_config_file, mask_token_id
from beam_hpu.model.dflash2_ops import exponential_noise
from beam_hpu.runtime.speculative import dflash2_context
from beam_hpu.runtime.speculative.dflash2_prefix import PrefixContexts, RequestTokens
from vllm.forward_context import set_forward_context
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer


logger = logging.getLogger("vllm." + __name__)  # vLLM's handler prints it in the engine's log


class CpuDFlash2Proposer(DFlashProposer):
    def __init__(self, vllm_config, device: torch.device, runner=None):
        # Resolved before the base, whose own lookup would refuse a config without either field
        # with a message that names no file.
        draft_model_config = vllm_config.speculative_config.draft_model_config
        self.mask_token_id = mask_token_id(draft_model_config.hf_config, drafter_config_file(draft_model_config))
        # DFlashProposer.__init__ registers warmups of the Triton input kernel this class never
        # calls; the base keeps the runner-facing state (buffers).
        SpecDecodeBaseProposer.__init__(self, vllm_config=vllm_config, device=device,
                                        pass_hidden_states_to_model=True, runner=runner)
        self.runner = runner
        self.dflash_causal = False
        draft = self.draft_model_config.hf_config
        self.window: int | None = getattr(draft, "sliding_window", None)
        self.contexts: dict[str, dflash2_context.RequestContext] = {}
        # Each request's tokens (None: not known, e.g. prompt embeddings) and the kept block rows.
        self.tokens: dict[str, RequestTokens | None] = {}
        self.prefix: PrefixContexts | None = None
        self.restored_once = False  # the first restore is logged

    def _create_draft_vllm_config(self):
        # DFlash v1's override only picks a non-causal vLLM attention backend; this drafter has none.
        return SpecDecodeBaseProposer._create_draft_vllm_config(self)

    def load_model(self, target_model: torch.nn.Module) -> None:
        self.model = self._get_model()
        self._draft_attn_layer_names = set()
        # The checkpoint has neither: the target's embedding and LM head (has_own_* False).
        self._maybe_share_embeddings(target_model)
        self._maybe_share_lm_head(target_model)

    def validate_same_kv_cache_group(self, kv_cache_config) -> None:
        pass  # no drafter layer lives in vLLM's KV cache

    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
        # The runner hands its drafter the common metadata of the drafter's KV cache group; any
        # group's query_start_loc and seq_lens are the same per request, so take the first.
        self.kv_cache_gid = 0
        self.draft_attn_groups = []
        self.block_size = (kernel_block_sizes or [kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size])[0]
        # vLLM's prefix-cache blocks, whatever the kernel's: the rows kept are found by its keys.
        cache_block = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.prefix = PrefixContexts(cache_block, kv_cache_config.num_blocks)

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, use_cudagraphs: bool = True, is_graph_capturing: bool = False,
                  slot_mappings=None) -> None:
        # One block of one request over one context row: the drafter's shapes run at startup.
        width = self.model.model.fc.input_size
        states = torch.zeros(1, width, dtype=self.dtype, device=self.device)
        positions = torch.zeros(1, dtype=torch.long, device=self.device)
        self._draft([0], [positions], states, torch.zeros(1, dtype=torch.long, device=self.device),
                    1 + self.num_speculative_tokens, keep=False)

    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None) -> torch.Tensor:
        self.num_speculative_tokens = num_speculative_tokens
        self._last_draft_probs = None
        num_reqs = common_attn_metadata.num_reqs
        starts = common_attn_metadata.query_start_loc_cpu[: num_reqs + 1].tolist()
        rejected = ([0] * num_reqs if num_rejected_tokens_gpu is None
                    else num_rejected_tokens_gpu[:num_reqs].tolist())
        # Each request's accepted rows of this step (a verify step's rejected drafts excluded).
        rows = [torch.arange(starts[i], starts[i + 1] - rejected[i], device=target_positions.device)
                for i in range(num_reqs)]
        req_ids = list(self.runner.input_batch.req_ids[:num_reqs])
        if self.prefix is not None and target_token_ids is not None:
            for req_id, r in zip(req_ids, rows):
                self._follow(req_id, target_positions[r], target_token_ids[r])
        drafts = self._draft(req_ids, [target_positions[r] for r in rows], target_hidden_states[torch.cat(rows)],
                             next_token_ids[:num_reqs], 1 + num_speculative_tokens, keep=True,
                             sampling=sampling_metadata)
        for gone in set(self.contexts) - set(self.runner.requests):
            del self.contexts[gone]
            self.tokens.pop(gone, None)
        return drafts

    def _follow(self, req_id: str, positions: torch.Tensor, ids: torch.Tensor) -> None:
        """Track the request's tokens through this step's accepted rows; a request new here that
        starts past 0 gets the kept rows of its cached blocks as its context."""
        if positions.numel() == 0:
            return
        first = int(positions[0])
        if req_id not in self.tokens:
            state = self.runner.requests[req_id]
            past = list(getattr(state, "prompt_token_ids", None) or []) + list(getattr(state, "output_token_ids", []))
            self.tokens[req_id] = RequestTokens(past[:first]) if len(past) >= first else None
            if self.tokens[req_id] is not None:
                self.tokens[req_id].rewind_and_append(first, ids.tolist(), self.prefix.block_size)
                if first > 0 and req_id not in self.contexts:
                    restored = self.prefix.restore(self.tokens[req_id].keys, first, self.window)
                    if restored is not None:
                        self.contexts[req_id] = restored
                        if not self.restored_once:
                            self.restored_once = True
                            logger.info("cpu-dflash2-proposer: a request starting at position %d (a prefix-cache "
                                        "hit) took back %d context rows of kept blocks", first,
                                        restored.positions.numel())
            return
        if self.tokens[req_id] is not None:
            self.tokens[req_id].rewind_and_append(first, ids.tolist(), self.prefix.block_size)

    def _draft(self, keys_of: list[Any], positions: list[torch.Tensor], states: torch.Tensor,
               bonus_ids: torch.Tensor, block: int, *, keep: bool, sampling=None) -> torch.Tensor:
        """Extend each request's context with its new rows' states, run one block, walk it.
        positions: one [n_i] tensor per request; states [sum n_i, n_states * H]; -> drafts [R, block - 1].
        `sampling` (vLLM's SamplingMetadata of the step) decides a sampled walk."""
        with set_forward_context(None, self.vllm_config, num_tokens=max(states.shape[0], 1)):
            keys, values = self.model.context_kv(self.model.combine_hidden_states(states),
                                                 torch.cat(positions))
            contexts, offset = [], 0
            for key, pos in zip(keys_of, positions):
                n = pos.shape[0]
                old = self.contexts.get(key) if keep else None
                ctx = dflash2_context.extend(old, pos, keys[:, offset:offset + n], values[:, offset:offset + n], None)
                offset += n
                known = self.tokens.get(key) if keep else None
                if known is not None and self.prefix is not None:
                    self.prefix.keep(known.keys, ctx)  # before the window cuts a long step's rows
                ctx = dflash2_context.extend(None, ctx.positions, ctx.keys, ctx.values, self.window)
                if keep:
                    self.contexts[key] = ctx
                contexts.append(ctx)
            if block == 1:  # dynamic speculation scheduled no drafts: the context still grows
                return torch.empty(len(contexts), 0, dtype=torch.long, device=bonus_ids.device)
            k, v, ctx_pos, valid = dflash2_context.batch(contexts)
            last = torch.tensor([c.last_position for c in contexts], device=bonus_ids.device)
            ids, block_pos, in_range = dflash2_context.block_inputs(bonus_ids, last, block, self.mask_token_id,
                                                                    self.max_model_len)
            hidden = self.model(ids, block_pos, DFlash2Context(k, v, ctx_pos, valid, in_range))
            if not self._samples(sampling):
                tokens, _, _ = self.model.draft_greedy(hidden, ids[:, 0])
                return tokens
            R = len(contexts)
            noise = exponential_noise(R, block - 1, self.model.model.candidate_selector.top_k, sampling.generators)
            tokens, dists, candidates = self.model.draft_sampled(hidden, ids[:, 0], sampling.temperature[:R], noise)
            # the drafter's vocabulary is the target's (its LM head is the target's): verification's width
            self._last_draft_probs = over_vocabulary(dists, candidates, self.model.config.vocab_size)
        return tokens

    def _samples(self, sampling) -> bool:
        return (sampling is not None and self._enable_probabilistic_draft_probs and not sampling.all_greedy
                and sampling.temperature is not None)


def over_vocabulary(dists: torch.Tensor, candidate_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, N, K] distributions over each position's candidates -> [R, N, V], zero off them (the
    candidates of a position are distinct: a top-k)."""
    out = dists.new_zeros(*dists.shape[:2], vocab)
    return out.scatter_(-1, candidate_ids, dists)
