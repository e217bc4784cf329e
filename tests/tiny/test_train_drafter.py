"""The tiny EAGLE3 drafter's trainer is deterministic, and the committed drafter is what it wrote.

A full re-training takes minutes on a shared CPU, so the determinism test runs a shortened
training twice (same bytes); the committed checkpoint carries the hyperparameters and the digest
the trainer computed, which its tensors must still match, and its config names the target's aux
layers and shape as vLLM's EAGLE3 loader reads them.
"""

import json

import torch

from beam_hpu.tiny import train_drafter as td
from beam_hpu.tiny.checkpoint import TRAINED_DIR
from beam_hpu.tiny.drafter import AUX_LAYERS, DRAFTER_DIR, WEIGHTS_FILE, read_drafter


def test_shortened_training_is_bitwise_reproducible():
    short = dict(td.DEFAULTS, steps=2, tokens=300)
    a = td.train(**short, log_every=0).published()
    b = td.train(**short, log_every=0).published()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # and it trained: two steps moved the layer away from its initialisation
    c = td.train(**dict(short, steps=1), log_every=0).published()
    assert not torch.equal(a["layers.0.self_attn.q_proj.weight"], c["layers.0.self_attn.q_proj.weight"])


def test_committed_drafter_is_the_trainers_output():
    from safetensors import safe_open

    with safe_open(str(DRAFTER_DIR / WEIGHTS_FILE), "pt") as f:
        meta = f.metadata()
    assert {k: meta[k] for k in td.DEFAULTS} == {k: str(v) for k, v in td.DEFAULTS.items()}
    assert meta["target"] == TRAINED_DIR.name
    assert td.weights_digest(read_drafter(DRAFTER_DIR)) == meta["sha256"]


def test_committed_config_is_an_eagle3_llama_for_the_tiny_beam():
    cfg = json.loads((DRAFTER_DIR / "config.json").read_text())
    target = json.loads((TRAINED_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX_LAYERS)
    assert max(AUX_LAYERS) <= target["num_hidden_layers"]
    assert cfg["hidden_size"] == cfg["target_hidden_size"] == target["hidden_size"]
    assert cfg["vocab_size"] == cfg["draft_vocab_size"] == target["vocab_size"]
    tensors = read_drafter(DRAFTER_DIR)
    assert "embed_tokens.weight" not in tensors  # vLLM shares the target's embedding
    assert tensors["fc.weight"].shape == (target["hidden_size"], len(AUX_LAYERS) * target["hidden_size"])
    assert sum(t.numel() * t.element_size() for t in tensors.values()) < 4 << 20
