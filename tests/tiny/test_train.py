"""The tiny Beam's trainer (beam_hpu.tiny.train): deterministic, and what it trains is what the
published checkpoint layout holds."""

import math

import torch


def test_training_prefix_is_deterministic_and_seed_dependent():
    from beam_hpu.tiny.train import state_digest, train

    a = state_digest(train(3, 3e-3, 0, 160, log_every=0)[0])
    b = state_digest(train(3, 3e-3, 0, 160, log_every=0)[0])
    c = state_digest(train(3, 3e-3, 1, 160, log_every=0)[0])
    assert a == b != c


def test_published_state_dict_round_trips_through_the_checkpoint(tmp_path):
    """Fused transformers experts -> published per-expert names -> transformers again: same logits."""
    from transformers.models.beam import BeamForCausalLM

    from beam_hpu.tiny.checkpoint import write_tiny_checkpoint
    from beam_hpu.tiny.train import PRESET, published_state_dict, train

    model, _ = train(1, 3e-3, 0, 160, log_every=0)
    write_tiny_checkpoint(tmp_path, PRESET, dtype="float32", num_shards=1,
                          state_dict=published_state_dict(model, torch.float32))
    back = BeamForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.tensor([list(range(8, 72))])
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, back(input_ids=ids).logits, atol=1e-5)
    assert math.isfinite(float(back(input_ids=ids).logits.sum()))
