"""The two `VLLM_BEAM_*` switches the parsers read.

Moves to beam_hpu.envs when merged: `beam_hpu/envs.py` (another branch) owns every switch; until
that lands this is the one place the parsers read them, so the move is a one-line change.
"""

from __future__ import annotations

import os

ALWAYS_CONSTRAIN_OUTPUT = "VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUT"
STREAM_TOOL_ARGS = "VLLM_BEAM_STREAM_TOOL_ARGS"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def switch_on(name: str) -> bool:
    """Both switches default to on ("1"), as the recipe sets them. Read per call, not cached:
    tests and the benchmark flip them within one process."""
    raw = os.environ.get(name, "1").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected 1 or 0")
