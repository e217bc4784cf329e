"""The tiny DFlash2 drafter's trainer is deterministic and trains both of its terms.

A full re-training takes minutes on a shared CPU, so this runs a shortened training twice (same
bytes) and once shorter (the tensors moved)."""

import torch

from beam_hpu.tiny import train_dflash2 as tt


def test_shortened_training_is_bitwise_reproducible():
    # 8 steps: 4 of short copies on the first row, 2 on the first two, 1 of long copies, 1 of the task
    # mix with the selector
    short = dict(tt.DEFAULTS, steps=8, tokens=300, anchors=4)
    a = tt.train(**short, log_every=0).published()
    b = tt.train(**short, log_every=0).published()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = tt.train(**dict(short, steps=7), log_every=0).published()
    for name in ("layers.0.self_attn.q_proj.weight", "layers.1.mlp_conv.kernel_projection.weight",
                 "candidate_selector.successor_codebook"):  # the block term and the selector term
        assert not torch.equal(a[name], c[name]), name


def test_anchors_leave_room_for_a_trained_first_row():
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, 5:9] = True
    seqs, starts = tt.anchor_batch(mask, 16, 8, torch.Generator().manual_seed(0))
    assert seqs.tolist() == [0, 0, 0, 0]  # the second sequence has nothing to learn
    assert starts.tolist() == [4, 5, 6, 7]  # a with mask[a + 1]


def test_committed_dflash2_is_the_trainers_output():
    import json

    from safetensors import safe_open

    from beam_hpu.model.dflash2 import validate_dflash2_config
    from beam_hpu.tiny.dflash2_drafter import DFLASH2_DIR, WEIGHTS_FILE, read_dflash2

    with safe_open(str(DFLASH2_DIR / WEIGHTS_FILE), "pt") as f:
        meta = f.metadata()
    assert {k: meta[k] for k in tt.DEFAULTS} == {k: str(v) for k, v in tt.DEFAULTS.items()}
    assert tt.weights_digest(read_dflash2(DFLASH2_DIR)) == meta["sha256"]
    cfg = json.loads((DFLASH2_DIR / "config.json").read_text())
    validate_dflash2_config(type("Config", (), cfg))
    assert "embed_tokens.weight" not in read_dflash2(DFLASH2_DIR)  # the target's is shared


def test_the_committed_drafter_copies_and_drafts_the_tasks():
    """What the trainer's product does, offline (fresh samples, not the training draws): on copies
    its first rows follow the passage, on tool calls it drafts most of the block; the same shapes
    untrained draft nothing."""
    from beam_hpu.tiny.dflash2_drafter import DFLASH2_DIR, DFlash2Shape, init_drafter, read_dflash2

    trained = init_drafter(DFlash2Shape()).load_published(read_dflash2(DFLASH2_DIR)).eval()
    untrained = init_drafter(DFlash2Shape()).eval()
    copy, tools = [("copy", 1.0)], [("tools", 1.0)]
    assert tt.offline_acceptance(trained, steps=2, mix=copy) > 1.2  # measured 1.49
    assert tt.offline_acceptance(trained, steps=2, mix=tools) > 5.5  # measured 6.01
    assert tt.offline_acceptance(untrained, steps=1, mix=tools) < 0.2
