"""Where the port's startup guards (`beam_hpu.envs.check_startup`) meet vLLM's parsed arguments.

vLLM 0.30.0 gives a general plugin no callback with the parsed arguments, so `register()` wraps
two methods, each looked up on its class at call time:

- `vllm serve`: the CLI parses the command line, then calls `ServeSubcommand.validate(args)`
  before anything starts. The CLI loads general plugins (so `register()` runs) while it builds
  the parser, after `vllm.entrypoints.cli.serve` is imported; the wrap checks the full namespace
  (frontend flags included: --tool-call-parser, --chat-template-content-format) of a Beam launch.
- every engine start (`vllm serve`, `LLM(...)`, an `AsyncLLM` of one's own):
  `EngineArgs.create_engine_config()` resolves the model's config; the wrap checks the engine
  arguments when the resolved `model_type` is `beam`.

A refused launch raises `StartupError` naming each culprit: `vllm serve` exits non-zero with it.
Nothing here imports vLLM: the wraps are installed only on modules already imported, so
`register()` stays cheap in the processes that have no CLI or engine arguments (workers).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from beam_hpu.envs import BEAM_PARSER, check_startup

logger = logging.getLogger("vllm.beam_hpu")

BEAM_MODEL_TYPE = "beam"
BEAM_LOAD_FORMAT = "beam"
_WRAPPED = "_beam_hpu_startup_guard"


def _model_type_on_disk(model: str | None) -> str | None:
    """`model_type` from the model's config.json when it is a local directory or already in the
    Hugging Face cache; None otherwise (never a network call)."""
    if not model:
        return None
    path = Path(model) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None
        cached = try_to_load_from_cache(model, "config.json")
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        return json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def is_beam_launch(args: Any) -> bool:
    """A launch the guards apply to: a Beam checkpoint, or the port's parsers or loader."""
    get = (lambda name: args.get(name)) if isinstance(args, dict) else (lambda name: getattr(args, name, None))
    if BEAM_PARSER in (get("reasoning_parser"), get("tool_call_parser")):
        return True
    if get("load_format") == BEAM_LOAD_FORMAT:
        return True
    return _model_type_on_disk(get("model") or get("model_tag")) == BEAM_MODEL_TYPE


def guard_serve_args(args: Any) -> None:
    """The `vllm serve` check: refuse a Beam launch the port does not support."""
    if is_beam_launch(args):
        check_startup(os.environ, args)


def guard_engine_config(engine_args: Any, config: Any) -> None:
    """The engine-start check, once the model's config is resolved."""
    hf_config = getattr(getattr(config, "model_config", None), "hf_config", None)
    if getattr(hf_config, "model_type", None) == BEAM_MODEL_TYPE or is_beam_launch(engine_args):
        check_startup(os.environ, engine_args)


def _wrap(cls: type, name: str, make) -> None:
    original = cls.__dict__.get(name)
    if original is None or getattr(original, _WRAPPED, False):
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _WRAPPED, True)
    setattr(cls, name, wrapper)


def _serve_validate(original):
    def validate(self, args):
        guard_serve_args(args)
        return original(self, args)

    return validate


def _create_engine_config(original):
    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        guard_engine_config(self, config)
        return config

    return create_engine_config


def install() -> None:
    """Wrap vLLM's argument checks in the modules this process has imported (idempotent)."""
    serve = sys.modules.get("vllm.entrypoints.cli.serve")
    if serve is not None and hasattr(serve, "ServeSubcommand"):
        _wrap(serve.ServeSubcommand, "validate", _serve_validate)
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    if arg_utils is not None and hasattr(arg_utils, "EngineArgs"):
        _wrap(arg_utils.EngineArgs, "create_engine_config", _create_engine_config)
