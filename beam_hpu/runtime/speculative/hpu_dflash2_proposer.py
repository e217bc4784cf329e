"""A DFlash2 proposer for vllm-gaudi's HPUModelRunner, for Beam's drafter (beam_hpu.model.dflash2).

vllm-gaudi builds only NgramProposer and HpuEagleProposer; for `"method": "dflash"` (which vLLM
0.30.0 counts as EAGLE) it would draft sequentially with EAGLE's loop. The port unit
`beam-dflash2-proposer` builds this class instead for a Beam target with a DFlash2 Beam drafter
and routes the runner's drafting to `propose`. What the CPU proposer (`cpu_dflash2_proposer`)
does with lists grown on the host, this one does with shapes fixed per (batch bucket, block), so
that a card compiles and captures one graph per decode batch bucket and block:

- the context is a `dflash2_ring.ContextRing` (W = the drafter's window rows per request slot,
  a slot per sequence the runner runs at once), written in the same step as the block is drafted;
- a decode step hands the drafter all B x (k + 1) rows of vllm-gaudi's padded verify layout and a
  [B, k + 1] mask of the accepted ones (built on the host from the sampled token lists the runner
  already read back), the bonus tokens and the slots as [B] tensors: three small host-to-device
  copies, no `nonzero` or read-back; this step is captured (an HPU graph per batch bucket);
- a prefill batch hands its [bs, T] rows (vllm-gaudi pads positions with -1: those rows, and rows
  older than the window, go to the ring's spare slot), uncaptured;
- the block: the bonus token and k mask tokens after each request's last accepted position, rows
  past max_model_len clamped and masked (`dflash2_context.block_inputs`), then the selector's
  walk: greedy, or with `draft_sample_method: probabilistic` sampled at each request's
  temperature (the runner's input batch) when a step has a sampled request, with noise drawn on
  the host as the CPU proposer draws it (`exponential_noise`: a seeded request's from its
  generator) and handed in as one more fixed-shape input.

A prefix-cache hit gives the target no states for the cached tokens, so a request whose first
prefill row is past 0 would draft without its past. As the CPU proposer does
(`dflash2_prefix`), the proposer follows each request's tokens through the step's token ids
(prefill batches' and the verify layout's), keeps on the device the ring rows of every full KV
block once its last row is written, keyed as vLLM keys the block, and hands a new request that
starts past 0 the kept rows of its cached blocks (found from its prompt's tokens) in its ring
slot before its first block. Kept blocks are bounded by the KV cache's block count and by
PREFIX_BYTES of device memory, least recently used out first.

Drafts go to verification as point masses, as the runner's other drafters': the port's
`beam-sampled-verify` and `beam-grammar-verify` verify them unchanged. That stays exact for a
sampled walk (a point-mass verifier is exact whatever drew the draft); it accepts less often than
dividing by the draft's probability, which vllm-gaudi's verify step does not take.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from beam_hpu.model.dflash2 import DFlash2ConfigError, drafter_config_file, mask_token_id, target_aux_layer_ids
from beam_hpu.model.dflash2_ops import GREEDY_BELOW, exponential_noise
from beam_hpu.runtime.speculative import dflash2_context
from beam_hpu.runtime.speculative.dflash2_context import RequestContext
from beam_hpu.runtime.speculative.dflash2_prefix import PrefixContexts, RequestTokens
from beam_hpu.runtime.speculative.dflash2_ring import ContextRing, SlotTable

logger = logging.getLogger(__name__)

# Device memory the kept prefix blocks may take: the published drafter's rows of one 128-token
# block take 5 layers x 128 x 2 x 1 KV head x 128 x 2 bytes (320 KiB) a card at TP 8.
PREFIX_BYTES = 1 << 30


class DFlash2Step(nn.Module):
    """One drafting step: store the step's context rows, draft one block per request. Every
    input's shape is fixed by (batch, rows per request); `block` and the model length are fixed
    at construction."""

    def __init__(self, drafter: nn.Module, ring: ContextRing, block: int, max_model_len: int) -> None:
        super().__init__()
        self.drafter, self.ring = drafter, ring
        self.block, self.max_model_len = block, max_model_len
        self.mask_token_id = int(drafter.mask_token_id)

    def forward(self, states: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, slots: torch.Tensor,
                bonus: torch.Tensor, temperature: torch.Tensor | None = None,
                noise: torch.Tensor | None = None) -> torch.Tensor:
        """states [R * T, n * H] (the target's auxiliary states, rows in positions' order), positions
        and valid [R, T], slots and bonus [R] -> drafts [R, block - 1]; with temperature [R] and
        exponential noise [R, block - 1, K] the walk is sampled."""
        # padding rows carry position -1 (prefill) or 0: inside the RoPE table, stored nowhere
        keys, values = self.drafter.context_kv(self.drafter.combine_hidden_states(states),
                                               positions.clamp(min=0).reshape(-1))
        self.ring.write(slots, positions, keys, values, valid)
        last = torch.where(valid, positions, -1).amax(dim=1)  # [R]: the last accepted position
        ids, block_pos, in_range = dflash2_context.block_inputs(bonus, last, self.block, self.mask_token_id,
                                                                self.max_model_len)
        hidden = self.drafter(ids, block_pos, self.ring.context(slots, last, in_range))
        if temperature is None:
            tokens, _, _ = self.drafter.draft_greedy(hidden, ids[:, 0])
        else:
            tokens, _, _ = self.drafter.draft_sampled(hidden, ids[:, 0], temperature, noise)
        return tokens


class HpuDFlash2Proposer:
    """The runner's drafter (`self.drafter`). No attribute `model`: vllm-gaudi would wrap one in its
    HpuModelAdapter, which only fits a model called like the target; `step` is captured as is."""

    def __init__(self, vllm_config: Any, device: torch.device | str, runner: Any = None) -> None:
        spec = vllm_config.speculative_config
        draft = spec.draft_model_config.hf_config
        self.vllm_config, self.device, self.runner = vllm_config, torch.device(device), runner
        self.num_speculative_tokens = int(spec.num_speculative_tokens)
        if not getattr(draft, "sliding_window", None):
            raise DFlash2ConfigError("DFlash2 drafter: config.sliding_window is missing (the context ring on "
                                     "HPU is one window long a request)")
        self.window = int(draft.sliding_window)
        # Refused here, before the drafter loads, when the config names no mask token; the step
        # reads the drafter's own (the same function's answer).
        mask_token_id(draft, drafter_config_file(spec.draft_model_config))
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        # The target's layers whose outputs the drafter reads (the runner asks for these).
        self.target_aux_layer_ids = tuple(target_aux_layer_ids(draft))
        self.slots = SlotTable(int(vllm_config.scheduler_config.max_num_seqs))
        self.sample_walks = getattr(spec, "draft_sample_method", "greedy") == "probabilistic"
        self.step: nn.Module | None = None
        self.prefix: PrefixContexts | None = None  # made at the first step that names the runner's block size
        self.tokens: dict[str, RequestTokens | None] = {}
        self.ring_from: dict[str, int] = {}  # each request's first position with rows in its slot
        self.pending: dict[str, int] = {}  # each request's last bonus token: the next step's first row
        self.restored_once = False  # the first restore is logged

    def load_model(self, target_model: nn.Module) -> None:
        from vllm.model_executor.model_loader import get_model

        spec = self.vllm_config.speculative_config
        drafter = get_model(vllm_config=self.vllm_config, model_config=spec.draft_model_config,
                            load_config=spec.draft_load_config)
        self.attach(drafter, target_model)

    def attach(self, drafter: nn.Module, target_model: nn.Module | None = None) -> None:
        """Give the drafter the target's embedding and LM head (its checkpoint has neither) and
        build the step with its ring on the drafter's device."""
        if target_model is not None:
            drafter.model.embed_tokens = target_model.model.embed_tokens
            drafter.lm_head = target_model.lm_head
        attn = drafter.model.layers[0].self_attn
        weight = drafter.model.fc.weight
        ring = ContextRing(len(drafter.model.layers), self.slots.spare, self.window, attn.num_kv_heads, attn.head_dim,
                           weight.dtype, weight.device)
        self.step = DFlash2Step(drafter, ring, self.num_speculative_tokens + 1, self.max_model_len)
        # Prefill batches run the step uncaptured (one graph per prompt bucket would be captured
        # otherwise); Habana's wrap_in_hpu_graph replaces the module's forward in place, so the
        # bound method taken first stays the plain one.
        self.eager_step = self.step.forward
        if self.device.type == "hpu":
            _capture_in_hpu_graphs(self.step)

    @property
    def ring(self) -> ContextRing:
        return self.step.ring

    def propose(self, runner: Any, sampled_token_ids: list[list[int]], aux_hidden_states: list[torch.Tensor] | None,
                aux_hidden_states_prefills: list[list[torch.Tensor]] | None, num_decodes: int, prefill_data: Any,
                decode_data: Any) -> torch.Tensor:
        """Drafts [decodes + prefilled requests, k] for one runner step, in the runner's order
        (decodes first, then each prefill batch's requests)."""
        self.slots.release_absent(set(runner.requests))
        for gone in set(self.tokens) - set(runner.requests):
            del self.tokens[gone]
            self.ring_from.pop(gone, None)
            self.pending.pop(gone, None)
        drafts = []
        if decode_data is not None and num_decodes:
            drafts.append(self._decode(runner, sampled_token_ids, aux_hidden_states, num_decodes, decode_data))
        if prefill_data is not None:
            token_ids = getattr(prefill_data, "token_ids", None) or [None] * len(prefill_data.request_ids)
            for idx, req_ids in enumerate(prefill_data.request_ids):
                drafts.append(self._prefill(runner, sampled_token_ids, aux_hidden_states_prefills[idx], req_ids,
                                            prefill_data.position_ids[idx], token_ids[idx]))
        if not drafts:
            return torch.zeros(0, self.num_speculative_tokens, dtype=torch.long, device=self.device)
        return torch.cat(drafts)

    def _decode(self, runner, sampled_token_ids, aux_hidden_states, num_decodes, decode_data) -> torch.Tensor:
        rows = decode_data.position_ids.numel()
        meta = decode_data.spec_decode_metadata
        # vllm-gaudi lays a verify step out as the padded batch x (its largest draft count + 1)
        batch = len(meta.num_draft_tokens) if meta is not None else rows
        per = rows // batch
        valid = torch.zeros(batch, per, dtype=torch.bool)
        bonus = torch.zeros(batch, dtype=torch.long)
        owners: list[str | None] = [None] * batch
        for i in range(num_decodes):
            tokens = sampled_token_ids[i]
            if tokens:  # rows 0..len - 1 hold the last bonus token and the accepted drafts
                valid[i, :len(tokens)] = True
                bonus[i] = tokens[-1]
                owners[i] = runner.input_batch.req_ids[i]
        positions = decode_data.position_ids.reshape(batch, per).long()
        states = _rows(aux_hidden_states, rows).view(batch, per, -1)
        # Steps whose sequences all carry fewer than k drafts (the grammar trimmed them, or the
        # model length) are laid out narrower: padded to k + 1 rows, they take the same graph.
        width = self.num_speculative_tokens + 1
        if per < width:
            states = torch.nn.functional.pad(states, (0, 0, 0, width - per))
            positions = torch.nn.functional.pad(positions, (0, width - per))
            valid = torch.nn.functional.pad(valid, (0, width - per))
        # The accepted rows' tokens, on the host: the last bonus token, then the drafts kept (the
        # sampled list but its new bonus), after the request's tokens so far.
        follow = [(i, owner, len(self.tokens[owner].tokens), [self.pending[owner]] + sampled_token_ids[i][:-1])
                  for i, owner in enumerate(owners[:num_decodes])
                  if sampled_token_ids[i] and self.tokens.get(owner) is not None and owner in self.pending]
        drafts = self._run(self.step, states.reshape(batch * width, -1), positions, valid.to(positions.device),
                           owners, bonus, runner, follow)
        return drafts[:num_decodes]

    def _prefill(self, runner, sampled_token_ids, aux_states, req_ids, positions, token_ids=None) -> torch.Tensor:
        bs, T = positions.shape
        bonus = torch.zeros(bs, dtype=torch.long)
        for r, req_id in enumerate(req_ids):
            tokens = sampled_token_ids[runner.input_batch.req_id_to_index[req_id]]
            bonus[r] = tokens[-1] if tokens else 0  # a chunk short of the prompt's end: drafts unused
        owners = list(req_ids) + [None] * (bs - len(req_ids))
        positions = positions.long()
        follow = []
        if token_ids is not None and self._prefix(runner) is not None:
            # the batch's rows and ids on the host: the runner read this step's samples back already
            host_positions, host_ids = positions.cpu(), token_ids.reshape(bs, T).cpu()
            for r, req_id in enumerate(req_ids):
                kept = host_positions[r] >= 0
                if bool(kept.any()):
                    follow.append((r, req_id, int(host_positions[r][kept][0]), host_ids[r][kept].tolist()))
        drafts = self._run(self.eager_step, _rows(aux_states, bs * T), positions, positions >= 0, owners, bonus,
                           runner, follow)
        return drafts[:len(req_ids)]

    def _run(self, step, states, positions, valid, owners, bonus, runner=None, follow=()) -> torch.Tensor:
        """follow: (row, request, first position, token ids) of the rows this step accepts, on the
        host: the requests' tokens followed for their prefix blocks (a prefill's new request first
        takes back its cached blocks' rows)."""
        slots, new = self.slots.assign(owners)
        device = positions.device
        for slot in new:
            self.ring.clear(torch.tensor([slot], device=device))
            if step is self.eager_step:  # a prompt: its request starts in this slot
                r = slots.index(slot)
                start = next((first for row, _, first, _ in follow if row == r), None)
                if start is not None and self.prefix is not None:
                    self._start(runner, owners[r], slot, start)
        from vllm.forward_context import set_forward_context

        walk = self._sampled_walk_inputs(runner, owners) if self.sample_walks and runner is not None else ()
        with set_forward_context(None, self.vllm_config, num_tokens=states.shape[0]):
            drafts = step(states, positions, valid, torch.tensor(slots, device=device), bonus.to(device),
                          *(t.to(device) for t in walk))
        for r, owner, first, ids in follow:
            self._keep(owner, slots[r], first, ids)
        for r, owner in enumerate(owners):
            if owner is not None:
                self.pending[owner] = int(bonus[r])
        return drafts

    def _prefix(self, runner) -> PrefixContexts | None:
        """The kept blocks, once the runner names its KV block size (vLLM's prefix-cache block)."""
        if self.prefix is None and getattr(runner, "block_size", None):
            ring, bs = self.ring, int(runner.block_size)
            block_bytes = 2 * ring.keys[:, 0, :1].numel() * bs * ring.keys.element_size()
            most = max(1, PREFIX_BYTES // block_bytes)
            kv_blocks = getattr(getattr(runner, "kv_cache_config", None), "num_blocks", None)
            self.prefix = PrefixContexts(bs, min(most, int(kv_blocks)) if kv_blocks else most)
        return self.prefix

    def _start(self, runner, owner: str, slot: int, first: int) -> None:
        """A request new to its slot: its tokens before `first` from its prompt; past 0 (a
        prefix-cache hit), the kept rows of its cached blocks into its slot."""
        state = runner.requests.get(owner)
        prompt = list(getattr(state, "prompt_token_ids", None) or [])
        if len(prompt) < first:  # not the prompt's tokens (a resumed request): nothing to key by
            self.tokens[owner] = None
            return
        prefix = self.prefix
        self.tokens[owner] = RequestTokens([])
        self.tokens[owner].rewind_and_append(0, prompt[:first], prefix.block_size)
        self.ring_from[owner] = first
        restored = prefix.restore(self.tokens[owner].keys, first, self.window) if first > 0 else None
        if restored is None:
            return
        device = self.ring.keys.device
        n = restored.positions.numel()
        self.ring.write(torch.tensor([slot], device=device), restored.positions.view(1, n).to(device),
                        restored.keys.to(device), restored.values.to(device),
                        torch.ones(1, n, dtype=torch.bool, device=device))
        self.ring_from[owner] = int(restored.positions[0])
        if not self.restored_once:
            self.restored_once = True
            logger.info("beam-dflash2-proposer: a request starting at position %d (a prefix-cache hit) took back "
                        "%d context rows of kept blocks", first, n)

    def _keep(self, owner: str, slot: int, first: int, ids: list[int]) -> None:
        """Follow the request's tokens through this step's accepted rows (from `first`) and keep
        every full block its slot now holds whole: rows from its first in the slot, within the
        window of its newest."""
        tokens, prefix = self.tokens.get(owner), self.prefix
        if tokens is None:
            return
        if first > len(tokens.tokens):  # rows this proposer never saw: nothing more to key by
            self.tokens[owner] = None
            return
        done = len(tokens.keys)
        tokens.rewind_and_append(first, ids, prefix.block_size)
        bs, newest = prefix.block_size, len(tokens.tokens) - 1
        oldest = max(self.ring_from.get(owner, 0), newest - self.window + 1)
        for b in range(max(min(done, first // bs), -(-oldest // bs)), len(tokens.keys)):
            positions = torch.arange(b * bs, (b + 1) * bs, device=self.ring.keys.device)
            rows = slot * self.window + positions.remainder(self.window)
            keys = self.ring.keys.flatten(1, 2).index_select(1, rows)
            values = self.ring.values.flatten(1, 2).index_select(1, rows)
            prefix.keep(tokens.keys[:b + 1], RequestContext(positions, keys, values))

    def _sampled_walk_inputs(self, runner, owners: list[str | None]) -> tuple[torch.Tensor, ...]:
        """(temperature [R], noise [R, k, K]) when a request of the step samples, else (): a greedy
        step keeps the greedy graph. Temperatures from vllm-gaudi's input batch (below 0: greedy),
        padding rows greedy; a seeded request's noise from its generator."""
        batch = runner.input_batch
        index = [batch.req_id_to_index.get(owner) if owner is not None else None for owner in owners]
        temperature = torch.tensor([max(float(batch.temperature_cpu[i]), 0.0) if i is not None else 0.0
                                    for i in index])
        if not bool((temperature >= GREEDY_BELOW).any()):
            return ()
        generators = {row: batch.generators[i] for row, i in enumerate(index)
                      if i is not None and i in getattr(batch, "generators", {})}
        top_k = self.step.drafter.model.candidate_selector.top_k
        return temperature, exponential_noise(len(owners), self.num_speculative_tokens, top_k, generators)


def _rows(states: list[torch.Tensor], rows: int) -> torch.Tensor:
    """The target's auxiliary states (one tensor per read layer) as [rows, n * H]."""
    return torch.cat([s.reshape(rows, -1) for s in states], dim=-1)


def _capture_in_hpu_graphs(step: nn.Module) -> None:
    """In lazy mode, one HPU graph per input shapes (Habana's wrap_in_hpu_graph, as vllm-gaudi wraps
    its models: it keys captured graphs by the inputs' shapes and dtypes and replaces `forward`)."""
    import habana_frameworks.torch as htorch

    if htorch.utils.internal.is_lazy():
        htorch.hpu.wrap_in_hpu_graph(step, disable_tensor_cache=True)
