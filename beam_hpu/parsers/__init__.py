"""Beam's output format on vLLM 0.30.0: the `beam` reasoning and tool parsers and the response
grammar, all derived from the checkpoint's `response_template` (template.py).

Modules: template (the format), messages (the output reader), arguments (typed argument JSON),
reasoning / tools (the two vLLM parsers), grammar (the structural tag), request (the request
adjustment that installs the grammar from the first token), switches (VLLM_BEAM_* flags),
untrusted (client text never becomes a control token in the prompt), validation (roles, tool
names and schemas refused with a 400 naming the culprit).
"""

from __future__ import annotations

NAME = "beam"
REASONING_PARSER = ("beam_hpu.parsers.reasoning", "BeamReasoningParser")
TOOL_PARSER = ("beam_hpu.parsers.tools", "BeamToolParser")


def register() -> None:
    """Register both parsers by name, lazily: vLLM imports them only in a process that uses them
    (the API server; the EngineCore for structured outputs). Idempotent and cheap: vLLM calls the
    plugin in every process."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    if NAME not in ReasoningParserManager.lazy_parsers and NAME not in ReasoningParserManager.reasoning_parsers:
        ReasoningParserManager.register_lazy_module(NAME, *REASONING_PARSER)
    if NAME not in ToolParserManager.lazy_parsers and NAME not in ToolParserManager.tool_parsers:
        ToolParserManager.register_lazy_module(NAME, *TOOL_PARSER)

    from beam_hpu.parsers.untrusted import install

    install()  # before vLLM builds its renderer; acts only on tokenizers with a response template
