"""`post_norm_gain`: the documented conditioning knob of the random tiny Beam."""

import json

import pytest
import torch

from beam_hpu.tiny.checkpoint import CONDITIONED_POST_NORM_GAIN, POST_NORMS, config_dict, preset, random_state_dict


def state(gain):
    cfg = config_dict(preset("small"), 480, {"<|endoftext|>": 0, "<|return|>": 1, "<|call|>": 2}, "bfloat16")
    return random_state_dict(cfg, 0, torch.float32, gain)


def test_gain_scales_only_the_post_norms():
    plain, conditioned = state(None), state(CONDITIONED_POST_NORM_GAIN)
    changed = {name for name in plain if not torch.equal(plain[name], conditioned[name])}
    assert changed == {n for n in plain if n.endswith(tuple(f"{p}.weight" for p in POST_NORMS))}
    assert len(changed) == 2 * 6
    for name in changed:
        torch.testing.assert_close(conditioned[name], plain[name] * CONDITIONED_POST_NORM_GAIN)


def test_gain_is_recorded_and_not_combined_with_a_state_dict(tmp_path):
    from beam_hpu.tiny.checkpoint import write_tiny_checkpoint

    out = write_tiny_checkpoint(tmp_path / "c", post_norm_gain=0.1)
    assert json.loads((out / "beam_tiny.json").read_text())["post_norm_gain"] == 0.1
    with pytest.raises(ValueError, match="post_norm_gain"):
        write_tiny_checkpoint(tmp_path / "d", state_dict={}, post_norm_gain=0.1)
