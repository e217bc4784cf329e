"""The one client every gate uses: the official `openai` client for chat and completions, httpx for
vLLM's extra endpoints (/health, /tokenize). Works against any OpenAI-compatible vLLM server."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx
import openai


@dataclass
class Endpoint:
    base_url: str  # ends with /v1
    model: str
    timeout: float = 3600.0
    client: openai.OpenAI = field(init=False)

    def __post_init__(self):
        self.base_url = self.base_url.rstrip("/")
        self.client = openai.OpenAI(base_url=self.base_url, api_key="EMPTY", timeout=self.timeout, max_retries=0)

    @property
    def root(self) -> str:
        return self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.root}/health", timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    def tokenize(self, text: str) -> list[int]:
        r = httpx.post(f"{self.root}/tokenize", json={"model": self.model, "prompt": text,
                                                      "add_special_tokens": False}, timeout=self.timeout)
        r.raise_for_status()
        return r.json()["tokens"]

    def complete_ids(self, prompt_ids: list[int], max_tokens: int, **extra) -> dict:
        """Greedy completion of a token-id prompt: {'token_ids', 'logprobs', 'text', 'finish_reason'}."""
        r = self.client.completions.create(model=self.model, prompt=prompt_ids, max_tokens=max_tokens,
                                           temperature=0.0, logprobs=1,
                                           extra_body={"return_token_ids": True, **extra})
        c = r.choices[0]
        return {"token_ids": list(c.token_ids), "logprobs": list(c.logprobs.token_logprobs),
                "text": c.text, "finish_reason": c.finish_reason}

    def prompt_logprobs(self, prompt_ids: list[int], k: int) -> list[dict[int, float] | None]:
        """Per prompt position: {token id: logprob} for the top-k and the actual token ([None] first)."""
        r = self.client.completions.create(model=self.model, prompt=prompt_ids, max_tokens=1, temperature=0.0,
                                           extra_body={"prompt_logprobs": k})
        raw = r.choices[0].model_extra["prompt_logprobs"]
        out = []
        for pos in raw:
            out.append(None if pos is None else {int(t): float(v["logprob"]) for t, v in pos.items()})
        return out

    def prompt_top(self, prompt_ids: list[int], k: int) -> list[tuple[dict[int, float], int] | None]:
        """Like `prompt_logprobs` but also the server's rank-1 token at each position."""
        r = self.client.completions.create(model=self.model, prompt=prompt_ids, max_tokens=1, temperature=0.0,
                                           extra_body={"prompt_logprobs": k})
        out = []
        for pos in r.choices[0].model_extra["prompt_logprobs"]:
            if pos is None:
                out.append(None)
                continue
            lps = {int(t): float(v["logprob"]) for t, v in pos.items()}
            top = min(pos.items(), key=lambda kv: kv[1]["rank"])[0]
            out.append((lps, int(top)))
        return out

    def chat(self, messages, **kw):
        return self.client.chat.completions.create(model=self.model, messages=messages, **kw)

    def chat_stream(self, messages, **kw) -> dict:
        """Stream a chat completion and assemble it: reasoning, content, tool calls, finish reason."""
        reasoning, content, calls, finish = [], [], {}, None
        for chunk in self.client.chat.completions.create(model=self.model, messages=messages, stream=True, **kw):
            if not chunk.choices:
                continue
            ch = chunk.choices[0]
            d = ch.delta
            extra = d.model_extra or {}
            r = extra.get("reasoning") or extra.get("reasoning_content")
            if r:
                reasoning.append(r)
            if d.content:
                content.append(d.content)
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.function and tc.function.name:
                    slot["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
            finish = ch.finish_reason or finish
        return {"reasoning": "".join(reasoning), "content": "".join(content),
                "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}


def assembled(resp) -> dict:
    """A non-streamed chat completion in the same shape as `Endpoint.chat_stream`."""
    c = resp.choices[0]
    m = c.message
    extra = m.model_extra or {}
    return {"reasoning": extra.get("reasoning") or extra.get("reasoning_content") or "",
            "content": m.content or "",
            "tool_calls": [{"name": t.function.name, "arguments": t.function.arguments} for t in m.tool_calls or []],
            "finish_reason": c.finish_reason}


def dumps(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str)
