"""beam_hpu.runtime.fp8.hpu_exact_rounding: which per-token FP8 quantiser a Gaudi layer gets (port unit
beam-exact-rounding; the patched tree itself runs in tests/runtime/fp8/test_tree_exact_rounding.py)."""

import pytest
import torch

from beam_hpu.runtime.fp8.hpu_exact_rounding import activation_quantiser, served_model_type
from beam_hpu.quant.rounding import FP8_E4M3FN_MAX, GAUDI2_FP8_MAX, per_token_fp8
from beam_hpu.settings.switches import SwitchError


@pytest.mark.parametrize("model_type,mode", [("beam", "0"), ("llama", "1"), ("qwen3_moe", "1"), (None, "0")])
def test_stock_dynamic_quant_unless_beam_with_the_switch_on(model_type, mode):
    assert activation_quantiser(model_type, GAUDI2_FP8_MAX, {"BEAM_EXACT_ROUNDING": mode}) is None


def test_default_is_the_recipes_stock_rounding():
    assert activation_quantiser("beam", GAUDI2_FP8_MAX, {}) is None


@pytest.mark.parametrize("fp8_max", [GAUDI2_FP8_MAX, FP8_E4M3FN_MAX])
def test_beam_with_the_switch_on_gets_the_references_rounding(fp8_max):
    quant = activation_quantiser("beam", fp8_max, {"BEAM_EXACT_ROUNDING": "1"})
    x = (torch.randn(6, 32, generator=torch.Generator().manual_seed(3)) * 5).to(torch.bfloat16)
    x[2] *= 1e-9
    q, scale = quant(x)
    want_q, want_scale = per_token_fp8(x, fp8_max, exact=True)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
    assert q.float().abs().amax() == fp8_max
    # and it is not vllm-gaudi's rounding on these bf16 activations
    assert not torch.equal(q.view(torch.uint8), per_token_fp8(x, fp8_max, exact=False)[0].view(torch.uint8))


def test_an_unknown_device_range_is_refused_naming_the_switch():
    with pytest.raises(ValueError, match=r"BEAM_EXACT_ROUNDING=1: vllm-gaudi's FP8_MAX is 57344"):
        activation_quantiser("beam", 57344.0, {"BEAM_EXACT_ROUNDING": "1"})


def test_an_unknown_model_type_with_the_switch_on_is_refused_naming_the_switch():
    with pytest.raises(ValueError, match=r"BEAM_EXACT_ROUNDING=1: no vLLM config is current"):
        activation_quantiser(None, GAUDI2_FP8_MAX, {"BEAM_EXACT_ROUNDING": "1"})


def test_a_bad_switch_value_is_refused_naming_the_variable():
    with pytest.raises(SwitchError, match="BEAM_EXACT_ROUNDING='yes'"):
        activation_quantiser("beam", GAUDI2_FP8_MAX, {"BEAM_EXACT_ROUNDING": "yes"})


def test_no_model_type_outside_a_vllm_config_context():
    assert served_model_type() is None
