"""End to end: the recipe's 11 tool cases through a real `vllm serve` (beam parsers, the
always-on response grammar, streamed tool arguments) with the official openai client.

The model is the tiny *trained* Beam (`beam_hpu/tiny/data/trained_tiny`, `beam_hpu.tiny.train`): it was
trained to reason briefly and then answer or call a tool, so its outputs terminate inside the
grammar. The assertions are the tools gate's (`beam_hpu/gates/tools.py`): structure only (calls
present when required, the named tool used, none when none, arguments valid against the tool's
schema, the json_schema answer valid, reasoning present, no template markup in content)."""

import json

import httpx
import pytest

from beam_hpu.gates import tools as gate
from beam_hpu.gates.client import Endpoint
from beam_hpu.gates.profile import get_profile
from beam_hpu.tiny.checkpoint import TRAINED_DIR
from tests.support.readme_requests import tool_call_request, tool_call_response

pytestmark = pytest.mark.slow
PROFILE = get_profile("cpu")


@pytest.fixture(scope="module")
def ep(shared_server):
    server = shared_server(TRAINED_DIR)
    return Endpoint(server.base_url, server.model)


@pytest.mark.parametrize("name,case,stream", gate.CASES, ids=[c[0] for c in gate.CASES])
def test_tool_case(ep, name, case, stream):
    case(ep, PROFILE, stream)


@pytest.mark.parametrize("case", [gate.case_auto, gate.case_required, gate.case_named])
def test_streamed_arguments_equal_the_non_streamed_ones(ep, case):
    whole, streamed = case(ep, PROFILE, False)["calls"], case(ep, PROFILE, True)["calls"]
    assert json.dumps(streamed, sort_keys=True) == json.dumps(whole, sort_keys=True)


def test_tools_gate_reports_11_of_11(ep):
    r = gate.run(ep, PROFILE)
    assert r.passed and "11/11" in r.result, r.details


def test_readme_tool_call_example(ep):
    """The README's tool-call request, sent as written, gets the call the README shows."""
    body, shown = tool_call_request(), tool_call_response()
    body["model"] = ep.model
    r = httpx.post(f"{ep.base_url}/chat/completions", json=body, timeout=120).json()
    message, expected = r["choices"][0]["message"], shown["choices"][0]["message"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert calls == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in expected["tool_calls"]]
    assert message["reasoning"] == expected["reasoning"]
    assert r["choices"][0]["finish_reason"] == shown["choices"][0]["finish_reason"]
