"""The two `VLLM_BEAM_*` switches the parsers read, through `beam_hpu.envs` (which owns every
switch: default, parsing, description)."""

from __future__ import annotations

import os

from beam_hpu.envs import read_switch

ALWAYS_CONSTRAIN_OUTPUT = "VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUT"
STREAM_TOOL_ARGS = "VLLM_BEAM_STREAM_TOOL_ARGS"


def switch_on(name: str) -> bool:
    """Read per call, not cached: tests and the benchmark flip them within one process."""
    return bool(read_switch(name, os.environ))
