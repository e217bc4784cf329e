"""Runtime patch `untrusted-text`: vLLM's chat-template step renders client text as text for Beam
tokenizers (`beam_hpu.parsers.untrusted.render_untrusted`), so no message, tool result, name or
schema string becomes a control token in the prompt."""

from __future__ import annotations

import functools
import sys

from beam_hpu.runtime.wrap import wrap

NAME = "untrusted-text"


def _render(original):
    from beam_hpu.parsers.untrusted import render_untrusted

    return functools.partial(render_untrusted, original)


def install() -> None:
    # Must run before vLLM builds its renderer, which binds the function once; general plugins
    # are loaded before that. The scoring path imports the function by name: it gets the wrapper
    # when imported after this, and is wrapped here when imported before.
    import vllm.renderers.hf as hf

    wrap(hf, "safe_apply_chat_template", _render, patch=NAME)
    scoring = sys.modules.get("vllm.entrypoints.pooling.scoring.io_processor")
    if scoring is not None and "safe_apply_chat_template" in vars(scoring):
        wrap(scoring, "safe_apply_chat_template", _render, patch=NAME)
