"""End to end: two replicas of the tiny trained Beam behind a real `vllm-router`
(cache-aware policy), started once for the module by the demo's own code (beam_hpu.replicas), on
loopback. What is asserted is read from the servers themselves: each replica's /metrics (finished
requests, prefix-cache hits), the router's worker list, and the answers.

The replica-kill test runs last (pytest keeps file order): it restarts the replica it kills."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from beam_hpu.demo.serve import SERVED_NAME
from beam_hpu.replicas import metrics
from beam_hpu.replicas.layout import plan
from beam_hpu.replicas.supervisor import Fleet
from beam_hpu.tiny.checkpoint import TRAINED_DIR
from tests.support.engines import REPO
from tests.support.parallel import VLLM_PORT_BASE, WORKER_PORT_SPAN, free_ports, worker_index

pytestmark = pytest.mark.slow

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
# A long shared prefix (a system prompt of several KV blocks of 128 tokens), as agentic traffic has.
SYSTEM = ("You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and repeat the user's word."
                                                      for i in range(60)))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    router_port, port0, port1, metrics_port = free_ports(4)
    # vLLM's internal ports: above the ones this worker's other engines use (tests/support/parallel.py).
    internal = VLLM_PORT_BASE + WORKER_PORT_SPAN * worker_index() + WORKER_PORT_SPAN // 2
    layout = plan(TRAINED_DIR, 2, router_port=router_port, replica_ports=[port0, port1], metrics_port=metrics_port,
                  internal_port_base=internal)
    f = Fleet(layout, tmp_path_factory.mktemp("replica-logs"), extra_env={"PYTHONPATH": str(REPO)})
    f.start(timeout=600)
    yield f
    f.stop()


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)


def snapshot(fleet) -> list[metrics.Counters]:
    return [metrics.read(r.url) for r in fleet.layout.replicas]


def chat(url, messages, **kw):
    return client(url).chat.completions.create(model=SERVED_NAME, messages=messages, temperature=0,
                                               max_tokens=kw.pop("max_tokens", 24), **kw)


def answer(r) -> dict:
    m = r.choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in (m.tool_calls or [])]
    return {"content": m.content, "reasoning": getattr(m, "reasoning", None), "calls": calls,
            "finish": r.choices[0].finish_reason}


def router_workers(fleet) -> dict:
    return httpx.get(f"{fleet.layout.router_url}/workers", timeout=5).json()


def burst(fleet, tag: str, n: int = 16) -> list[float]:
    """`n` requests at once through the router; how many each replica finished. "At once": every
    client is built first and a barrier releases all sends together. Built one by one inside the
    threads, the clients spread the arrivals over about half a second, and on a fast host each
    short answer finished before the next arrived, so the router never saw enough in flight to
    balance (seen once: [0, 16])."""
    before = snapshot(fleet)
    clients = [client(fleet.layout.router_url) for _ in range(n)]
    start = threading.Barrier(n)

    def one(i):
        start.wait(timeout=60)
        return clients[i].chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": f"Repeat after me: {tag}{i}"}],
            temperature=0, max_tokens=48)

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)
    return [(a - b).requests for a, b in zip(snapshot(fleet), before)]


def test_both_replicas_serve_traffic(fleet):
    """16 requests at once: the cache-aware policy would keep them on one replica (their text
    shares the chat scaffold), until the in-flight difference passes the balance threshold
    (RouterSettings.balance_abs_threshold): then the other replica takes requests too."""
    served = burst(fleet, "w")
    assert sum(served) == 16 and min(served) >= 1, served


def test_conversations_sharing_a_long_prefix_land_on_one_replica(fleet):
    before = snapshot(fleet)
    for word in ("alpha", "bravo", "charlie", "delta"):
        chat(fleet.layout.router_url, [{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": f"Repeat after me: {word}"}], max_tokens=4)
    delta = [a - b for a, b in zip(snapshot(fleet), before)]
    home = max(range(2), key=lambda i: delta[i].requests)
    assert [d.requests for d in delta] == [4 if i == home else 0 for i in range(2)], delta
    # The three after the first found the shared prefix cached (whole 128-token blocks).
    first_prompt = delta[home].queries / 4
    assert delta[home].hits >= 3 * 128 and delta[home].hit_rate > 0.5, (delta[home], first_prompt)


def test_answers_through_the_router_equal_the_direct_ones(fleet):
    direct = fleet.layout.replicas[0].url
    cases = [
        dict(messages=[{"role": "user", "content": "Repeat after me: Paris"}], max_tokens=32),
        dict(messages=[{"role": "user", "content": "What is the weather in Rome for 3 days?"}], tools=[WEATHER_TOOL],
             max_tokens=128),
    ]
    for case in cases:
        assert answer(chat(fleet.layout.router_url, **case)) == answer(chat(direct, **case))
    # The README's answers, through the router (its port stands for the demo's 8000).
    readme = answer(chat(fleet.layout.router_url, **cases[0]))
    assert readme["content"] == "Paris" and readme["reasoning"] == "The user wants Paris."
    tool = answer(chat(fleet.layout.router_url, **cases[1]))
    assert tool["calls"] == [("get_weather", {"city": "Rome", "days": 3})] and tool["finish"] == "tool_calls"


def _streamed(url, **case) -> dict:
    content, reasoning, args, names = "", "", {}, {}
    for chunk in client(url).chat.completions.create(model=SERVED_NAME, temperature=0, stream=True, **case):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning", None) or ""
        for c in d.tool_calls or []:
            if c.function and c.function.name:
                names[c.index] = c.function.name
            args[c.index] = args.get(c.index, "") + ((c.function.arguments or "") if c.function else "")
    return {"content": content, "reasoning": reasoning,
            "calls": [(names[i], json.loads(args[i])) for i in sorted(names)]}


def test_streaming_through_the_router_equals_direct(fleet):
    direct = fleet.layout.replicas[1].url
    for case in (dict(messages=[{"role": "user", "content": "Repeat after me: Rome"}], max_tokens=32),
                 dict(messages=[{"role": "user", "content": "What is the weather in Rome for 3 days?"}],
                      tools=[WEATHER_TOOL], max_tokens=128)):
        routed = _streamed(fleet.layout.router_url, **case)
        assert routed == _streamed(direct, **case)
        assert routed["reasoning"] and (routed["content"] or routed["calls"])


def test_a_killed_replica_is_routed_around_and_rejoins(fleet):
    """SIGKILL (a crash) the replica the router sends this prompt to: every request still succeeds
    within a bound (the router retries; its circuit breaker sends the retry to the other replica),
    its worker list marks the dead one, and after a restart the replica is healthy again in the
    router and takes requests."""
    prompt = [{"role": "user", "content": "Repeat after me: crash"}]
    before = snapshot(fleet)
    chat(fleet.layout.router_url, prompt, max_tokens=4)
    home = [i for i, (a, b) in enumerate(zip(snapshot(fleet), before)) if (a - b).requests][0]
    other, dead = fleet.layout.replicas[1 - home], fleet.layout.replicas[home]
    fleet.kill_replica(home, signal.SIGKILL)
    before = metrics.read(other.url)
    for word in ("crash", "one", "two", "three", "four", "five"):
        start = time.monotonic()
        r = chat(fleet.layout.router_url, [{"role": "user", "content": f"Repeat after me: {word}"}], max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert time.monotonic() - start < 30
    assert (metrics.read(other.url) - before).requests == 6
    deadline = time.monotonic() + 30
    while _worker_healthy(fleet, dead.url) is not False:
        assert time.monotonic() < deadline, router_workers(fleet)
        time.sleep(1)
    assert httpx.get(f"{fleet.layout.router_url}/readiness", timeout=5).json()["healthy_workers"] == 1

    fleet.restart_replica(home, timeout=600)
    deadline = time.monotonic() + 60
    while not _worker_healthy(fleet, dead.url):
        assert time.monotonic() < deadline, router_workers(fleet)
        time.sleep(1)
    assert httpx.get(f"{fleet.layout.router_url}/readiness", timeout=5).json()["healthy_workers"] == 2
    time.sleep(fleet_settings_cb_timeout(fleet))  # the breaker lets the restarted replica be tried again
    assert burst(fleet, "back")[home] >= 1


def fleet_settings_cb_timeout(fleet) -> float:
    cmd = fleet.layout.router_cmd
    return float(cmd[cmd.index("--cb-timeout-duration-secs") + 1]) + 1


def _worker_healthy(fleet, url):
    """The router's view of one worker: True / False, None when it does not list it."""
    for w in router_workers(fleet).get("workers", []):
        if w.get("url") == url:
            return bool(w.get("is_healthy"))
    return None
