"""What the served speculative-decoding tests read from a server: its spec-decode counters and
chat answers as a client assembles them."""

import httpx


def spec_counters(server) -> dict[str, float]:
    """Sums of vLLM's spec-decode counters on the server's /metrics (0 when absent)."""
    text = httpx.get(server.base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
    names = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens_total": "accepted"}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in names:
            out[names[name]] += float(line.rsplit(" ", 1)[1])
    return out


def accepted_and_rejected(accepted: float, draft_tokens: float) -> bool:
    """Whether a run's verify steps both accepted and rejected drafted tokens: only then do answers
    equal to the plain server's show the verifier lossless (they would be equal alike if every
    draft were accepted by a verifier that ignores the target, or none drafted)."""
    return 0 < accepted < draft_tokens


def chat_once(client, model, req, stream, max_tokens=96):
    """One chat request at temperature 0 as the client sees it, streamed or not."""
    kw = dict(model=model, temperature=0, max_tokens=max_tokens, **req)
    if not stream:
        m = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in m.message.tool_calls or []]
        return {"reasoning": getattr(m.message, "reasoning", None), "content": m.message.content,
                "calls": calls, "finish": m.finish_reason}
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        d = c.delta
        reasoning += getattr(d, "reasoning", None) or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            name, args = calls.get(tc.index, ("", ""))
            name += (tc.function and tc.function.name) or ""
            piece = (tc.function and tc.function.arguments) or ""
            calls[tc.index] = (name, args + piece)
        finish = c.finish_reason or finish
    # Delta boundaries are not compared: a verify step emits several tokens at once, so the
    # speculative server streams fewer, longer pieces; what they add up to must be the same.
    return {"reasoning": reasoning or None, "content": content or None,
            "calls": [calls[i] for i in sorted(calls)], "finish": finish}
