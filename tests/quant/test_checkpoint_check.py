"""FP8 checkpoints that break their own quantization_config are refused, naming the tensor or scheme.

The unit tests run the check on files; the slow test starts real vLLM engines on the broken
checkpoints and reads the error the engine start fails with.
"""

import re

import pytest

from beam_hpu.quant.checkpoint_check import check_fp8_checkpoint, tensor_headers
from tests.support.engines import run_engine

from . import broken_checkpoints as broken


def test_good_checkpoint_passes(tiny_pair):
    check_fp8_checkpoint(tiny_pair[1])
    check_fp8_checkpoint(tiny_pair[0])  # unquantised: nothing to check


def test_headers_are_read_without_tensor_data(tiny_pair):
    headers = tensor_headers(tiny_pair[1])
    assert headers[broken.WRONG_SHAPE] == ("F32", [32, 1])
    assert headers[broken.WRONG_SHAPE.replace("weight_scale", "weight")] == ("F8_E4M3", [32, 64])
    assert headers["model.layers.1.mlp.gate.weight"] == ("F32", [8, 64])  # the router: not quantised


@pytest.mark.parametrize("make,message", [
    (broken.wrong_shape_scale, re.escape(broken.WRONG_SHAPE) + r" is F32 \[1, 1\]; expected F32 \[32, 1\]"),
    (broken.missing_scale, re.escape(broken.MISSING) + " is missing"),
    (lambda s, d: broken.missing_scale(s, d, broken.MISSING_EXPERT), re.escape(broken.MISSING_EXPERT) + " is missing"),
    (broken.unsupported_scheme, r"config group 'group_0' has an unsupported quantisation scheme \(weights: float "
                                r"8-bit, strategy channel, symmetric, static; input_activations: float 8-bit, "
                                r"strategy tensor, symmetric, static\)"),
    (broken.unquantised_target, r"model\.layers\.1\.self_attn\.q_proj\.weight is targeted .* BF16"),
])
def test_broken_checkpoint_is_refused_by_name(tiny_pair, tmp_path, make, message):
    bad = make(tiny_pair[1], tmp_path / "bad")
    with pytest.raises(ValueError, match=message):
        check_fp8_checkpoint(bad)


def test_scheme_check_is_off_where_vllm_gaudi_decides(tiny_pair, tmp_path):
    bad = broken.unsupported_scheme(tiny_pair[1], tmp_path / "bad")
    check_fp8_checkpoint(bad, require_portable_scheme=False)  # HPU: vllm-gaudi's methods judge schemes


@pytest.mark.slow
@pytest.mark.parametrize("make,message", [
    (broken.wrong_shape_scale, re.escape(broken.WRONG_SHAPE) + r" is F32 \[1, 1\]; expected F32 \[32, 1\]"),
    (lambda s, d: broken.missing_scale(s, d, broken.MISSING_EXPERT), re.escape(broken.MISSING_EXPERT) + " is missing"),
    (broken.unsupported_scheme, r"unsupported quantisation scheme .*strategy tensor, symmetric, static"),
], ids=["wrong-shape-scale", "missing-weight-scale", "unsupported-scheme"])
def test_vllm_engine_start_fails_naming_the_culprit(tiny_pair, tmp_path, make, message):
    bad = make(tiny_pair[1], tmp_path / "bad")
    with pytest.raises(RuntimeError, match="engine failed") as failure:
        run_engine(bad, [{"prompt_logprobs": [5, 6, 7]}], max_model_len=256, timeout=600)
    log = str(failure.value)
    assert re.search(r"ValueError: .*" + message, log), log[-3000:]
