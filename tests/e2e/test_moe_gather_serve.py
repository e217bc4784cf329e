"""BEAM_MOE_GATHER on a real `vllm serve` of the FP8 tiny trained Beam (portable FP8 experts): greedy
outputs are token for token those of the dense path, at TP 2 + expert parallel.

With the switch at 64 every step of these requests takes the gathered path (decode steps of 1 or
3 tokens, prompts under 64 tokens): G = min(local experts, T x 2) of a rank's 4 experts (EP). The log proves it ran (one line per gathered token count, from the workers), and
that with 0 it did not. Requests go one at a time, then three in one completions call (a 3-row
decode batch), in the same order on both servers.
"""

import httpx
import pytest

from beam_hpu.demo.serve import write_checkpoint
from tests.support.server import Server

pytestmark = pytest.mark.slow

PROMPTS = ["Repeat after me: Paris", "Repeat after me: blue whale", "What is the weather in Rome?"]
MAX_TOKENS = 24
GATHERED = "gathered path for"


def completion(server, prompt, **extra) -> list[dict]:
    body = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0,
            "ignore_eos": True,
            **extra}
    r = httpx.post(f"{server.base_url}/completions", json=body, timeout=300)
    r.raise_for_status()
    return sorted(r.json()["choices"], key=lambda c: c["index"])


def serve_and_ask(model_dir, limit: int, tp: int, ep: bool) -> tuple[list[list[str]], list[list[float]], str]:
    server = Server(model_dir, tp=tp, ep=ep, env={"BEAM_MOE_GATHER": str(limit)})
    try:
        choices = [c for p in PROMPTS for c in completion(server, p)]
        choices += completion(server, PROMPTS)  # three rows decoding together
        log = server.log_text()
    finally:
        server.stop()
    tokens = [c["logprobs"]["tokens"] for c in choices]
    logprobs = [c["logprobs"]["token_logprobs"] for c in choices]
    return tokens, logprobs, log


@pytest.fixture(scope="module")
def fp8_trained(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gather-fp8") / "beam", "trained", "bfloat16", 0, fp8=True)


# TP 2 + expert parallel only: it runs the gathered path with an expert map on each rank's 4 of 8
# experts, end to end through the served engine. TP 1 (all 8 experts local, no map) adds no engine
# wiring of its own; its op is compared with the dense pass bit for bit, at T = 1..16, in
# tests/runtime/fp8/test_hpu_moe_gather.py::test_gathered_equals_dense_bit_for_bit.
@pytest.mark.parametrize("tp,ep", [(2, True)], ids=["tp2-ep"])
def test_greedy_tokens_equal_with_the_gathered_path_on_and_off(fp8_trained, tp, ep):
    off_tokens, off_logprobs, off_log = serve_and_ask(fp8_trained, 0, tp, ep)
    on_tokens, on_logprobs, on_log = serve_and_ask(fp8_trained, 64, tp, ep)
    # The switch acted: the gathered path ran (decode at 1 token and at 3) only when on.
    assert GATHERED not in off_log
    assert f"{GATHERED} 1 tokens" in on_log and f"{GATHERED} 3 tokens" in on_log, on_log[-4000:]
    local = 8 // tp
    assert f"(2 of {local} local experts" in on_log  # T = 1: G = top-2
    assert all(len(t) == MAX_TOKENS for t in off_tokens)
    assert on_tokens == off_tokens
    # Not asserted (host kernels may differ by accumulation order), reported: measured 0.0 here.
    worst = max(abs(a - b) for x, y in zip(on_logprobs, off_logprobs) for a, b in zip(x, y) if a is not None)
    print(f"tp={tp} ep={ep}: max |logprob on - off| = {worst}")
