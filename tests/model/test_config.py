"""Bad Beam configs are refused with a message naming the field; good ones (incl. the published
defaults) pass. The last test shows the refusal reaching a user through a real vLLM engine start."""

import json
import shutil

import pytest

from beam_hpu.model.config import BeamConfigError, beam_config_class, validate_beam_config


def published():
    # transformers' BeamConfig defaults are the published checkpoint's config.
    return beam_config_class()()


def test_published_config_is_valid_and_has_beams_layer_pattern():
    cfg = published()
    validate_beam_config(cfg)
    full = [i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention"]
    assert full == [5, 11, 17, 23, 29, 35, 41, 47, 51]
    assert cfg.mlp_layer_types[:4] == ["dense", "dense", "dense", "sparse"]


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("layer_types", ["sliding_attention"] * 51, "`layer_types`"),
        ("layer_types", ["sliding_attention"] * 51 + ["global"], "`layer_types` has unknown kinds ['global']"),
        ("mlp_layer_types", ["dense"] * 3 + ["moe"] * 49, "`mlp_layer_types` has unknown kinds ['moe']"),
        ("num_key_value_heads", 7, "`num_attention_heads` (48) must be divisible by `num_key_value_heads` (7)"),
        ("topk_group", 9, "`topk_group` (9) must be between 1 and `n_group` (8)"),
        ("n_group", 7, "`num_experts` (256) must be divisible by `n_group` (7)"),
        ("num_experts_per_tok", 200, "`num_experts_per_tok` (200)"),
        ("sliding_window", None, "`sliding_window`"),
        ("rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                             "full_attention": {"rope_type": "default", "rope_theta": 1e4}},
         "`rope_parameters.full_attention` must be null"),
    ],
)
def test_bad_config_names_the_field(field, value, needle):
    cfg = published()
    object.__setattr__(cfg, field, value)  # bypass transformers' own strict checks: test ours
    with pytest.raises(BeamConfigError) as e:
        validate_beam_config(cfg)
    assert needle in str(e.value)


@pytest.mark.slow
def test_engine_start_refuses_bad_config_naming_the_field(tiny_fp32, tmp_path):
    from tests.support.engines import run_engine

    bad = tmp_path / "bad"
    shutil.copytree(tiny_fp32, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["topk_group"] = cfg["n_group"] + 1
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RuntimeError) as e:
        run_engine(bad, [{"prompt_logprobs": [1, 2, 3]}])
    assert f"`topk_group` ({cfg['n_group'] + 1}) must be between 1 and `n_group` ({cfg['n_group']})" in str(e.value)
