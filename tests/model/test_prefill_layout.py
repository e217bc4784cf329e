"""Beam's forward takes the token layout vllm-gaudi's model adapter hands it: for a model whose type
is not in vllm-gaudi's `flatten_input` list (extension/features.py: qwen3_moe, granitemoe, glm4_moe,
gemma4; Beam is not, and the recipe does not set VLLM_FLATTEN_INPUT), a prompt batch arrives as
input_ids and positions [B, S] (HpuModelAdapter.forward flattens them only under flatten_input), so
the layers see hidden states [B, S, H]. vLLM's CPU runner hands [T]. The same tokens must give the
same hidden states either way.

Vllm's own layers on CPU, with the attention kernel replaced by one plain causal attention over all
rows (tests/support/gaudi/beam_layers.py): the layout, not attention, is under test, and that
attention sees the same rows in both layouts.
"""
from __future__ import annotations

import torch

from tests.support.gaudi import beam_layers as bl


def test_a_batch_of_prompts_as_b_by_s_gives_the_flat_layouts_hidden_states():
    model, config = bl.build()
    bl.without_attention_backend(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(8, 512, (2, 20), generator=g)
    positions = torch.arange(20).repeat(2, 1)
    with torch.no_grad(), bl.forward_context(config):
        flat = model(ids.reshape(-1), positions.reshape(-1))
        batched = model(ids, positions)
    assert batched.shape == (2, 20, model.config.hidden_size)
    torch.testing.assert_close(batched.reshape(flat.shape), flat, atol=0, rtol=0)
