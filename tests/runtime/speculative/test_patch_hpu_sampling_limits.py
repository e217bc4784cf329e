"""The runtime patch hpu-speculative-sampling-limits on vLLM's own SamplingParams.verify, with real
vLLM configs of the committed tiny Beam: the wrapper built for an HPU process refuses what the Gaudi
verify step cannot serve with VLLMValidationError naming the field (vLLM's OpenAI server answers it
with HTTP 400); built for CPU, or without speculation, it changes nothing. Installed on HPU only
(platform "hpu" in the index), so here the wrapper is built directly and SamplingParams is left as is."""

from __future__ import annotations

import pytest

from beam_hpu.runtime.speculative.patch_hpu_sampling_limits import with_limits
from tests.support.engines import REPO

TINY = REPO / "beam_hpu/tiny/data/trained_tiny"


@pytest.fixture(scope="module")
def configs():
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    model = ModelConfig(model=str(TINY), max_model_len=256)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1,
                             target_model_config=model, target_parallel_config=ParallelConfig())
    return model, spec


def test_hpu_refuses_unverifiable_fields_naming_them(configs):
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    model, spec = configs
    verify = with_limits(SamplingParams.verify, "hpu")
    for field, value in (("presence_penalty", 0.5), ("min_tokens", 2), ("logprobs", 1)):
        with pytest.raises(VLLMValidationError, match=f"^{field} cannot be served") as refused:
            verify(SamplingParams(temperature=0.7, top_p=0.99, **{field: value}), model, spec, None, None)
        assert refused.value.parameter == field
    # Beam's recommended sampling, a seed, greedy: served
    for ok in (SamplingParams(temperature=0.7, top_p=0.99), SamplingParams(temperature=0.7, seed=3),
               SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=20)):
        verify(ok, model, spec, None, None)
    # vLLM's own refusal under speculation comes first, unchanged
    with pytest.raises(VLLMValidationError, match="min_p and logit_bias"):
        verify(SamplingParams(temperature=0.7, min_p=0.1), model, spec, None, None)


def test_cpu_or_no_speculation_is_stock(configs):
    from vllm.sampling_params import SamplingParams

    model, spec = configs
    penalised = SamplingParams(temperature=0.7, presence_penalty=0.5, logprobs=1)
    with_limits(SamplingParams.verify, "cpu")(penalised, model, spec, None, None)
    with_limits(SamplingParams.verify, "hpu")(penalised, model, None, None, None)
