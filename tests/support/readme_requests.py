"""The requests the README shows, read from it (so a test sends what a reader would)."""

import json

from tests.support.engines import REPO

PARIS = "Repeat after me: Paris"


def readme_block(marker: str) -> str:
    """The first fenced block after `marker` in the top README."""
    text = (REPO / "README.md").read_text()
    block = text[text.index(marker):]
    return block[block.index("```"):].split("\n", 1)[1].split("```", 1)[0]


def tool_call_request() -> dict:
    """The README's tool-call request body (its heredoc), without a model."""
    request = readme_block("<!-- tool-call-request -->")
    heredoc = "<<'EOF'\n"
    return json.loads(request[request.index(heredoc) + len(heredoc):request.rindex("EOF")])


def tool_call_response() -> dict:
    """The answer the README shows for it."""
    return json.loads(readme_block("<!-- tool-call-response -->"))


def demo_requests(model: str) -> list[dict]:
    """The demo's first request (the README's curl) and its tool-call request, for `model`."""
    paris = {"messages": [{"role": "user", "content": PARIS}], "max_tokens": 32}
    return [dict(paris, model=model), dict(tool_call_request(), model=model)]
