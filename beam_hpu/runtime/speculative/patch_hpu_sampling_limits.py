"""Runtime patch `hpu-speculative-sampling-limits`: a request the Gaudi verify step cannot serve
is refused with HTTP 400 naming its field, instead of reaching the engine.

vLLM checks every request's SamplingParams against the engine's configs in `SamplingParams.verify`
(in the API server, before the engine sees the request; min_p and logit_bias are refused there
already under speculation). The wrap runs the stock checks, then
`beam_hpu.runtime.speculative.hpu_sampled_verify.request_refusal` (Beam model, HPU, --speculative-config only) and
raises vLLM's VLLMValidationError, which the OpenAI server answers with 400.
"""

from __future__ import annotations

from beam_hpu.runtime.wrap import wrap

NAME = "hpu-speculative-sampling-limits"


def with_limits(stock_verify, device_type: str):
    """SamplingParams.verify, then the HPU verify step's limits for `device_type`."""
    from beam_hpu.runtime.speculative.hpu_sampled_verify import request_refusal

    def verify(self, model_config, speculative_config, *args, **kwargs):
        stock_verify(self, model_config, speculative_config, *args, **kwargs)
        hf_config = getattr(model_config, "hf_config", None)
        refusal = request_refusal(self, model_type=getattr(hf_config, "model_type", None),
                                  speculative=speculative_config is not None, device_type=device_type)
        if refusal is not None:
            from vllm.exceptions import VLLMValidationError

            field, message = refusal
            raise VLLMValidationError(message, parameter=field)

    return verify


def install() -> None:
    from vllm.platforms import current_platform
    from vllm.sampling_params import SamplingParams

    device_type = str(current_platform.device_type)
    wrap(SamplingParams, "verify", lambda stock: with_limits(stock, device_type), patch=NAME)
