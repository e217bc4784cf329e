"""Beam's output format on vLLM 0.30.0: the `beam` reasoning and tool parsers and the response
grammar, all derived from the checkpoint's `response_template` (template.py).

Modules: template (the format), messages (the output reader), arguments (typed argument JSON),
reasoning / tools (the two vLLM parsers), grammar (the structural tag), request (the request
adjustment that installs the grammar from the first token), untrusted (client text never
becomes a control token in the prompt), validation (roles, tool names and schemas refused with a
400 naming the culprit). The VLLM_BEAM_* switches they read are in `beam_hpu.settings.switches`;
the bundled `response_template.json` is the published one.
"""

from __future__ import annotations

from beam_hpu.names import PARSER as NAME
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
