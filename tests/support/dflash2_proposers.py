"""The two DFlash2 proposers driven without an engine, with the committed tiny drafter: the Gaudi one
(HpuDFlash2Proposer) as vllm-gaudi's runner hands it steps, the vLLM-CPU one (CpuDFlash2Proposer)
as vLLM's V1 runner does. Run inside a current VllmConfig (the step's forward context reads it)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from beam_hpu.runtime.speculative.dflash2_prefix import PrefixContexts


def hpu_proposer(model, k: int, *, max_num_seqs: int = 4, max_model_len: int | None = None, target=None):
    """`target`: the served model whose embedding and LM head the drafter takes, as vllm-gaudi's
    runner attaches it (the committed drafter's own are random otherwise)."""
    from vllm.config import get_current_vllm_config

    from beam_hpu.runtime.speculative.hpu_dflash2_proposer import HpuDFlash2Proposer

    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k,
                                           draft_model_config=SimpleNamespace(hf_config=model.config)),
        model_config=SimpleNamespace(max_model_len=max_model_len or model.config.max_position_embeddings),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs))
    p = HpuDFlash2Proposer(config, "cpu")
    p.vllm_config = get_current_vllm_config()  # what the step's forward context reads
    p.attach(model, target)
    return p


class Runner:
    """What the Gaudi proposer reads of vllm-gaudi's runner: its requests and input batch order;
    with `prompts` ({request: prompt token ids}) and `block_size`, what its prefix blocks need."""

    def __init__(self, req_ids, prompts: dict | None = None, block_size: int | None = None):
        prompts = prompts or {}
        self.requests = {r: SimpleNamespace(prompt_token_ids=prompts.get(r)) for r in req_ids}
        self.input_batch = SimpleNamespace(req_ids=list(req_ids), req_id_to_index={r: i for i, r in enumerate(req_ids)})
        if block_size is not None:
            self.block_size = block_size


def per_layer(states: torch.Tensor, n_states: int) -> list[torch.Tensor]:
    """[rows, n * H] -> the runner's auxiliary states, one [rows, H] tensor per read layer."""
    return list(states.chunk(n_states, dim=-1))


def hpu_prefill(p, runner, rows: dict, bonus: dict, n_states: int, T: int = 12, bs: int = 4,
                ids: dict | None = None) -> torch.Tensor:
    """One prefill batch: request r's rows[r] = (first position, [n, n * H] states), padded to
    bs x T as vllm-gaudi pads it (position -1); `ids[r]`, the rows' token ids, where given."""
    first_states = next(iter(rows.values()))[1]
    positions = torch.full((bs, T), -1, dtype=torch.int32)
    token_ids = torch.zeros(bs, T, dtype=torch.int32)
    states = first_states.new_zeros(bs, T, first_states.shape[-1])
    for i, (req_id, (start, s)) in enumerate(rows.items()):
        positions[i, :s.shape[0]] = torch.arange(start, start + s.shape[0])
        states[i, :s.shape[0]] = s
        if ids is not None:
            token_ids[i, :s.shape[0]] = torch.tensor(ids[req_id])
    sampled = [[] for _ in runner.input_batch.req_ids]
    for req_id, token in bonus.items():
        sampled[runner.input_batch.req_id_to_index[req_id]] = [token]
    data = SimpleNamespace(request_ids=[list(rows)], position_ids=[positions],
                           **({} if ids is None else {"token_ids": [token_ids]}))
    return p.propose(runner, sampled, None, [per_layer(states.view(bs * T, -1), n_states)], 0, data, None)


def hpu_verify(p, runner, first: list[int], states: list[torch.Tensor], sampled: list[list[int]], n_states: int,
               per: int, batch: int = 4) -> torch.Tensor:
    """One verify step of the decodes in runner order: sequence i's rows at first[i] .. (states[i]
    [n_i, n * H] each, rejected rows included; n_i <= per, n_i - 1 its drafts), sampled[i] its
    accepted tokens + bonus. Laid out as vllm-gaudi's _create_decode_input_data does: batch x per,
    a sequence's rows past its own padded with position 0."""
    n = len(first)
    positions = torch.zeros(batch * per, 1, dtype=torch.int32)
    rows = states[0].new_zeros(batch * per, states[0].shape[-1])
    for i in range(n):
        m = states[i].shape[0]
        positions[i * per:i * per + m, 0] = torch.arange(first[i], first[i] + m)
        rows[i * per:i * per + m] = states[i]
    # a step without drafts at all is a plain decode: vllm-gaudi builds no spec-decode metadata
    drafts = [s.shape[0] - 1 for s in states] + [0] * (batch - n)
    meta = SimpleNamespace(num_draft_tokens=drafts) if per > 1 else None
    data = SimpleNamespace(position_ids=positions, spec_decode_metadata=meta)
    return p.propose(runner, sampled, per_layer(rows, n_states), None, n, None, data)


def cpu_proposer(model, req_ids, *, window: int | None = None, max_model_len: int | None = None,
                 sample_walks: bool = False, block_size: int | None = None, prompts: dict | None = None):
    """CpuDFlash2Proposer's engine-free part: what propose() reads, set as its __init__ and
    load_model would for `model` in a runner holding `req_ids`; `sample_walks` as
    `draft_sample_method: probabilistic` sets it; with a KV `block_size` it keeps block rows for
    prefix-cache hits (initialize_attn_backend), `prompts` the requests' prompt token ids."""
    from vllm.config import VllmConfig

    from beam_hpu.runtime.speculative.cpu_dflash2_proposer import CpuDFlash2Proposer

    p = object.__new__(CpuDFlash2Proposer)
    p.model, p.mask_token_id, p.contexts = model, model.mask_token_id, {}
    p.window = window if window is not None else model.config.sliding_window
    p.vllm_config, p.num_speculative_tokens = VllmConfig(), 0
    p._enable_probabilistic_draft_probs = sample_walks
    p.tokens, p.prefix = {}, None if block_size is None else PrefixContexts(block_size, 1 << 20)
    p.restored_once = False
    p.max_model_len = max_model_len or model.config.max_position_embeddings
    p.runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=list(req_ids)), requests={})
    for r in req_ids:
        admit(p, r, (prompts or {}).get(r))
    return p


def admit(p, req_id: str, prompt: list[int] | None = None) -> None:
    """A request joins the runner (its state: the prompt's token ids, no output yet)."""
    p.runner.requests[req_id] = SimpleNamespace(prompt_token_ids=prompt, output_token_ids=[])
    if req_id not in p.runner.input_batch.req_ids:
        p.runner.input_batch.req_ids.append(req_id)


def cpu_propose(p, k: int, lengths: list[int], positions: torch.Tensor, states: torch.Tensor,
                bonus: torch.Tensor, rejected: list[int] | None = None, sampling=None,
                token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One step of vLLM's V1 runner: request i's lengths[i] rows in order (positions and states
    concatenated, `token_ids` the tokens at them), the last rejected[i] of them rejected drafts;
    `sampling` the step's SamplingMetadata (all_greedy, temperature, generators), None for a
    greedy batch."""
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    meta = SimpleNamespace(num_reqs=len(lengths), query_start_loc_cpu=starts)
    return p.propose(k, token_ids, positions, states, bonus, None, meta, sampling,
                     num_rejected_tokens_gpu=None if rejected is None else torch.tensor(rejected))
