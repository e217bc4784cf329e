"""The per-token FP8 reference: rounding where the kernels round, and only there."""

import shutil

import pytest
import torch

from beam_hpu.quant.metrics import mean_kl, perplexity_change
from beam_hpu.reference.in_memory import (
    GAUDI2_FP8_MAX,
    INPUT_QUANT_ATTR,
    fake_quant_per_token,
    load_oracle,
    load_reference,
    next_token_logprobs,
    prompt_logprobs,
    set_activation_quant,
)
from tests.support.prompts import PROMPTS


@pytest.fixture(scope="module")
def prompt_ids(conditioned_pair):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(conditioned_pair[0]))
    return [tok(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(conditioned_pair):
    model = load_reference(conditioned_pair[1])
    yield model
    set_activation_quant(model, 448.0)


def all_logprobs(model, prompts):
    return torch.cat([next_token_logprobs(model, ids) for ids in prompts])


def test_fake_quant_rows_land_on_the_e4m3_grid():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -3.0, 0.3], [1e-3, 2e-3, -4e-3]])
    for fp8_max in (448.0, GAUDI2_FP8_MAX):
        y = fake_quant_per_token(x, fp8_max)
        scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / fp8_max
        q = y / scale  # back on the FP8 grid, up to fp32 rounding of the division
        assert torch.allclose(q, q.to(torch.float8_e4m3fn).float(), rtol=1e-6, atol=0)
        assert torch.allclose(q.abs().amax(dim=1)[1:], torch.tensor([fp8_max, fp8_max]), rtol=1e-6)
        assert torch.equal(y[0], torch.zeros(3))
    # 0.3 * 448 / 3 = 44.8 rounds to 44 (grid step 4 in [32, 64)): the rounding is real.
    assert fake_quant_per_token(x)[1, 2].item() == pytest.approx(44 * 3 / 448)


def test_hooks_cover_every_quantised_linear_and_expert(reference):
    from transformers.models.beam.modeling_beam import BeamExperts

    linears = [m for m in reference.beam_fp8_modules if isinstance(m, torch.nn.Linear)]
    experts = [m for m in reference.beam_fp8_modules if isinstance(m, BeamExperts)]
    # small preset: 6 layers x (q, k, v, o, output gate) + 1 dense MLP x (gate, up, down); 5 MoE layers.
    assert (len(linears), len(experts)) == (6 * 5 + 3, 5)
    assert reference.lm_head not in reference.beam_fp8_modules


def test_expert_hook_equals_transformers_experts_when_not_rounding(reference, prompt_ids):
    set_activation_quant(reference, None)
    ours = all_logprobs(reference, prompt_ids)
    reference.set_experts_implementation("eager")
    try:
        theirs = all_logprobs(reference, prompt_ids)
    finally:
        reference.set_experts_implementation("beam_fp8_reference")
        set_activation_quant(reference, 448.0)
    assert (ours - theirs).abs().max().item() < 1e-4


def test_removing_activation_rounding_changes_logprobs(reference, prompt_ids):
    rounded = all_logprobs(reference, prompt_ids)
    assert torch.equal(rounded, all_logprobs(reference, prompt_ids))  # deterministic
    set_activation_quant(reference, None)
    try:
        weight_only = all_logprobs(reference, prompt_ids)
    finally:
        set_activation_quant(reference, 448.0)
    assert (rounded - weight_only).abs().max().item() > 1e-2
    assert mean_kl(rounded, weight_only) > 1e-4


@pytest.mark.parametrize("group", ["linears", "experts"])
def test_each_group_of_inputs_is_rounded(reference, prompt_ids, group):
    from transformers.models.beam.modeling_beam import BeamExperts

    rounded = all_logprobs(reference, prompt_ids)
    members = [m for m in reference.beam_fp8_modules if isinstance(m, BeamExperts) == (group == "experts")]
    try:
        for m in members:
            setattr(m, INPUT_QUANT_ATTR, None)
        partly = all_logprobs(reference, prompt_ids)
    finally:
        set_activation_quant(reference, 448.0)
    assert (rounded - partly).abs().max().item() > 1e-3


def test_gaudi2_range_is_a_different_rounding(conditioned_pair, reference, prompt_ids):
    gaudi2 = load_reference(conditioned_pair[1], fp8_max=GAUDI2_FP8_MAX)
    assert (all_logprobs(gaudi2, prompt_ids) - all_logprobs(reference, prompt_ids)).abs().max().item() > 1e-3


def test_reference_perplexity_within_two_percent_of_bf16_oracle(conditioned_pair, reference, prompt_ids):
    oracle = load_oracle(conditioned_pair[0], torch.bfloat16)
    ref_lp = torch.cat([prompt_logprobs(reference, ids) for ids in prompt_ids])
    oracle_lp = torch.cat([prompt_logprobs(oracle, ids) for ids in prompt_ids])
    assert abs(perplexity_change(ref_lp, oracle_lp)) < 0.02
    assert mean_kl(all_logprobs(oracle, prompt_ids), all_logprobs(reference, prompt_ids)) < 0.01


def test_fp8_checkpoint_oracle_is_weight_only(conditioned_pair, reference, prompt_ids):
    set_activation_quant(reference, None)
    try:
        weight_only = all_logprobs(reference, prompt_ids)
    finally:
        set_activation_quant(reference, 448.0)
    oracle = load_oracle(conditioned_pair[1], torch.float32)
    assert (all_logprobs(oracle, prompt_ids) - weight_only).abs().max().item() < 1e-4


def test_missing_weight_scale_is_named(conditioned_pair, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(conditioned_pair[1], broken)
    victim = "model.layers.3.mlp.experts.5.down_proj.weight_scale"
    for shard in broken.glob("*.safetensors"):
        tensors = load_file(str(shard))
        if tensors.pop(victim, None) is not None:
            save_file(tensors, str(shard))
    with pytest.raises(ValueError, match=victim.replace(".", r"\.")):
        load_reference(broken)


def test_unquantised_checkpoint_is_refused(conditioned_pair):
    with pytest.raises(ValueError, match="not an FP8 checkpoint"):
        load_reference(conditioned_pair[0])
