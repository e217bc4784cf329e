"""The soak's requests: a fixed mix of cases, one HTTP exchange each, and what the client saw.

Every case is sent as a client would (httpx, or a raw socket for the disconnecting client) and
ends in exactly one status:

- `completed`: HTTP 200 and a `finish_reason` (a stream's last choice chunk carries it);
- `refused`: a case the server must refuse answered with HTTP 4xx (`wrong` if it was served);
- `cancelled` / `disconnected`: the client closed the stream / reset the socket mid-stream, as
  planned;
- `error`: a clean failure the client can see and act on: HTTP >= 400 with a body, or an SSE
  error event (`data: {"error": ...}`) in the stream;
- `broken`: the connection failed under the client (refused, reset, an incomplete chunked body):
  the client knows, but got no error message;
- `truncated`: a stream that ended normally without a `finish_reason` or an error event: a silent
  truncation, i.e. a lost request;
- `hung`: no end by the deadline (the client's read timeout, or a total past it).

`answer` (content, reasoning, tool calls) of a greedy completed case is what the soak compares with
the unfaulted run's.
"""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

from beam_hpu.demo.serve import SERVED_NAME
from beam_hpu.tiny import tasks as syn

LOST = ("truncated", "hung", "wrong")


@dataclass(frozen=True)
class Case:
    name: str
    body: dict
    expect: str = "complete"  # "complete", "refuse", "cancel" (after `cut` SSE events), "disconnect"
    # One event: vLLM's first event of a stream is the role chunk, which never carries a finish_reason.
    # A later cut is a race with the host: a client that falls behind gets the server's queued tokens
    # merged into few events, and 400 ignore_eos tokens have finished within 4 of them.
    cut: int = 1

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class Outcome:
    case: str
    status: str
    seconds: float
    ttft: float | None = None  # streams: first content, reasoning or tool-call delta
    http: int | None = None
    answer: tuple | None = None
    detail: str = ""
    started: float = field(default=0.0, repr=False)  # time.monotonic() at send


def _chat(messages, max_tokens=48, **kw) -> dict:
    return {"model": SERVED_NAME, "messages": messages, "temperature": 0, "max_tokens": max_tokens, **kw}


def cases() -> list[Case]:
    """The mix, in the order the clients cycle through it. Long prompts are needle retrievals in
    480 words of filler (about 1,900 tokens of the tiny model's 4,096 context; the tiny model was
    trained on 560, so its answer need not be right, only the same every time); the refused case
    asks for more tokens than the context holds (vLLM answers 400)."""
    rng = random.Random(28)
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    long_prompts = [syn.needle_prompt(syn.filler_text(rng, 480, syn.english_pieces()), syn.random_key(rng),
                                      syn.random_code(rng), depth) for depth in (0.2, 0.7)]
    endless = dict(ignore_eos=True, max_tokens=400)
    return [
        Case("echo", _chat(user("Repeat after me: Paris"))),
        Case("echo-stream", _chat(user("Repeat after me: Oslo Lima"), stream=True)),
        Case("tool", _chat(user(syn.weather_prompt("Rome", 3)), max_tokens=128, tools=syn.TOOLS)),
        Case("tool-stream", _chat(user(syn.weather_prompt("Cairo", 2)), max_tokens=128, tools=syn.TOOLS, stream=True)),
        Case("long", _chat(user(long_prompts[0]), max_tokens=40)),
        Case("long-stream", _chat(user(long_prompts[1]), max_tokens=40, stream=True)),
        Case("cancel", _chat(user("Repeat after me: Bern"), stream=True, **endless), expect="cancel"),
        Case("refused", _chat(user("Repeat after me: Riga"), max_tokens=100_000), expect="refuse"),
        Case("echo-2", _chat(user("Repeat after me: Sofia Accra"))),
        Case("disconnect", _chat(user("Repeat after me: Doha"), stream=True, **endless), expect="disconnect"),
    ]


def _message_answer(message: dict) -> tuple:
    calls = tuple((c["function"]["name"], json.dumps(json.loads(c["function"]["arguments"]), sort_keys=True))
                  for c in message.get("tool_calls") or [])
    return (message.get("content") or "", message.get("reasoning") or "", calls)


class _StreamState:
    def __init__(self):
        self.content, self.reasoning, self.names, self.args = "", "", {}, {}
        self.finish, self.error, self.done, self.chunks, self.first = None, None, False, 0, None
        self.events = 0  # every `data:` event but [DONE] (a token-bearing chunk may carry several tokens)

    def feed(self, line: str, started: float) -> None:
        if not line.startswith("data: "):
            return
        payload = line[6:]
        if payload == "[DONE]":
            self.done = True
            return
        data = json.loads(payload)
        self.events += 1
        if "error" in data:
            self.error = data["error"]
            return
        for choice in data.get("choices") or []:
            d = choice.get("delta") or {}
            piece = (d.get("content") or "") + (d.get("reasoning") or "")
            for c in d.get("tool_calls") or []:
                fn = c.get("function") or {}
                if fn.get("name"):
                    self.names[c["index"]] = fn["name"]
                self.args[c["index"]] = self.args.get(c["index"], "") + (fn.get("arguments") or "")
                piece = piece or "call"
            self.content += d.get("content") or ""
            self.reasoning += d.get("reasoning") or ""
            if piece:
                self.chunks += 1
                if self.first is None:
                    self.first = time.monotonic() - started
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]

    def answer(self) -> tuple:
        calls = tuple((self.names[i], json.dumps(json.loads(self.args[i]), sort_keys=True)) for i in sorted(self.names))
        return (self.content, self.reasoning, calls)


def send(base_url: str, case: Case, deadline: float,
         on_line: Callable[[str, "_StreamState"], None] | None = None) -> Outcome:
    """One exchange of `case` with the server at `base_url` (no /v1); never raises for a server's
    behaviour, only reports it. `on_line` sees each line of a stream as it arrives, with what the
    stream carried so far."""
    started = time.monotonic()
    if case.expect == "disconnect":
        return _disconnect(base_url, case, deadline, started)
    timeout = httpx.Timeout(connect=10.0, read=deadline, write=10.0, pool=10.0)
    out = Outcome(case.name, "broken", 0.0, started=started)
    try:
        with httpx.Client(timeout=timeout) as client:
            if case.stream:
                _stream(client, base_url, case, out, started, on_line)
            else:
                r = client.post(f"{base_url}/v1/chat/completions", json=case.body)
                out.http = r.status_code
                _plain(r, case, out)
    except httpx.TimeoutException as e:
        out.status, out.detail = "hung", f"{type(e).__name__} after {time.monotonic() - started:.1f}s"
    except (httpx.TransportError, json.JSONDecodeError) as e:
        out.status, out.detail = "broken", f"{type(e).__name__}: {e}"[:300]
    out.seconds = time.monotonic() - started
    if out.seconds > deadline and out.status not in ("hung",):
        out.detail, out.status = f"{out.status} but after {out.seconds:.1f}s (deadline {deadline:.0f}s)", "hung"
    return out


def _plain(r: httpx.Response, case: Case, out: Outcome) -> None:
    if r.status_code >= 400:
        if case.expect == "refuse" and r.status_code < 500:
            out.status = "refused"
        else:
            out.status = "error"
        out.detail = r.text[:300]
        return
    if case.expect == "refuse":
        out.status, out.detail = "wrong", "served a request that must be refused"
        return
    choice = r.json()["choices"][0]
    if choice.get("finish_reason"):
        out.status, out.answer = "completed", _message_answer(choice["message"])
    else:
        out.status, out.detail = "truncated", "HTTP 200 without finish_reason"


def _stream(client: httpx.Client, base_url: str, case: Case, out: Outcome, started: float,
            on_line: Callable[[str, "_StreamState"], None] | None) -> None:
    state = _StreamState()
    with client.stream("POST", f"{base_url}/v1/chat/completions", json=case.body) as r:
        out.http = r.status_code
        if r.status_code >= 400:
            out.status, out.detail = "error", r.read().decode(errors="replace")[:300]
            return
        for line in r.iter_lines():
            state.feed(line, started)
            if on_line is not None and line.startswith("data: "):
                on_line(line, state)
            # Counted in events, not in text-bearing chunks: the tiny model's text past its answer
            # (ignore_eos) can be empty for many tokens, and one seen run finished its 400 tokens
            # within 4 text-bearing chunks.
            if case.expect == "cancel" and state.events >= case.cut and state.finish is None:
                out.status, out.ttft, out.detail = "cancelled", state.first, f"closed after {state.events} events"
                return  # leaving the block closes the connection mid-stream
            if state.done:
                break
    out.ttft = state.first
    if state.error is not None:
        out.status, out.detail = "error", json.dumps(state.error)[:300]
    elif state.finish is not None:
        out.status, out.answer = "completed", state.answer()
    else:
        out.status, out.detail = "truncated", f"stream ended after {state.chunks} chunks, no finish_reason or error"


# How the vanishing client reports a server that closed the connection before the first event.
CLOSED_BEFORE_DATA = "connection closed before the first event"


def _disconnect(base_url: str, case: Case, deadline: float, started: float) -> Outcome:
    """A client that vanishes: raw HTTP/1.1, read until the first SSE data, then reset the socket."""
    u = urlparse(base_url)
    body = json.dumps(case.body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nAccept: text/event-stream\r\n\r\n").encode()
    seen = b""
    try:
        with socket.create_connection((u.hostname, u.port), timeout=deadline) as s:
            s.sendall(head + body)
            while b"data: " not in seen:
                part = s.recv(4096)
                if not part:  # the server went away after its headers, before the stream's first event
                    return Outcome(case.name, "broken", time.monotonic() - started,
                                   detail=f"{CLOSED_BEFORE_DATA} ({len(seen)} bytes read): "
                                          + seen[:200].decode(errors="replace"))
                seen += part
            status = int(seen.split(b" ", 2)[1])
            # SO_LINGER 0: close sends RST, as a crashed client or a dropped network would.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        ttft = time.monotonic() - started
        if status != 200:
            return Outcome(case.name, "error", ttft, http=status, detail=seen[:300].decode(errors="replace"))
        return Outcome(case.name, "disconnected", ttft, ttft=ttft, http=status, started=started)
    except socket.timeout:
        return Outcome(case.name, "hung", time.monotonic() - started, detail="no data before the deadline")
    except OSError as e:
        return Outcome(case.name, "broken", time.monotonic() - started, detail=f"{type(e).__name__}: {e}")
