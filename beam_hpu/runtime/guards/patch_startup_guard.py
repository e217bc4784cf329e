"""Runtime patch `startup-guard`: the port's launch guards on vLLM's parsed arguments.

vLLM 0.30.0 gives a general plugin no callback with the parsed arguments, so this wraps two
methods and calls `beam_hpu.settings.guards` from them:

- `vllm serve`: the CLI parses the command line, then calls `ServeSubcommand.validate(args)`
  before anything starts. The CLI loads general plugins (so `register()` runs) while it builds
  the parser, after `vllm.entrypoints.cli.serve` is imported; the wrap checks the full namespace
  (frontend flags included: --tool-call-parser, --chat-template-content-format) of a Beam launch.
- every engine start (`vllm serve`, `LLM(...)`, an `AsyncLLM` of one's own):
  `EngineArgs.create_engine_config()` resolves the model's config; the wrap checks the engine
  arguments when the resolved `model_type` is `beam`.

A refused launch raises `StartupError` naming each culprit: `vllm serve` exits non-zero with it.
Nothing here imports vLLM: the wraps go only on modules this process has already imported, so
`register()` stays cheap in the processes that have no CLI or engine arguments (workers).
"""

from __future__ import annotations

import sys

from beam_hpu.runtime.wrap import wrap
from beam_hpu.settings.guards import guard_engine_config, guard_serve_args

NAME = "startup-guard"


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
    serve = sys.modules.get("vllm.entrypoints.cli.serve")
    if serve is not None and hasattr(serve, "ServeSubcommand"):
        wrap(serve.ServeSubcommand, "validate", _serve_validate, patch=NAME)
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    if arg_utils is not None and hasattr(arg_utils, "EngineArgs"):
        wrap(arg_utils.EngineArgs, "create_engine_config", _create_engine_config, patch=NAME)
