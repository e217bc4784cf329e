"""An incremental reader of Beam's output: text in (any chunking), events out.

One machine serves both the reasoning and the tool parser and both the streaming and the
non-streaming paths (non-streaming = one `feed` + `finish`), so the four can never disagree on
what the model wrote. It never raises on malformed output: what it cannot place is reported as a
`stray` or `unknown` event and dropped by the parsers, with a warning.

Events (`Event.kind`):
  reasoning(text)          text of the thinking message
  content(text)            text of an answer message (or prelude text, see `prelude_is_content`)
  call_open(name)          a tool-call message began
  param_open(name=key) / param_text(text) / param_close(name=key, text=value) / param_cut(name=key)
                           a parameter of the open call; values are stripped as the template says;
                           `param_cut` = the output ended inside the value
  call_close(cut)          the call ended (`cut`: the output ended inside it, mid-parameter)
  stray(text)              text outside any message, or a broken header
  unknown(text)            the body of a message with a channel the template does not define

The last closer of an output (`<|call|>`, `<|return|>`) is an EOS token, which vLLM leaves out of
the text; so the end of the output also ends the open message.
"""

from __future__ import annotations

from dataclasses import dataclass

from beam_hpu.parsers.template import CONTROL_TOKEN_PREFIX, CONTROL_TOKEN_RE, ResponseTemplate


@dataclass
class Event:
    kind: str
    text: str = ""
    name: str | None = None
    cut: bool = False


def _partial_suffix(text: str, literals) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `literals`: text the
    next chunk may turn into that literal, so it is held back."""
    best = 0
    for lit in literals:
        for n in range(min(len(lit) - 1, len(text)), best, -1):
            if text.endswith(lit[:n]):
                best = n
                break
    return best


class _Arguments:
    """The `<rfl:parameter name="K">V</rfl:parameter>` sequence inside a call body."""

    def __init__(self, t: ResponseTemplate):
        self.begin, self.between = t.parameter_begin
        self.end = t.parameter_end
        self.strip = t.strip_values
        self.buf = ""
        self.key: str | None = None  # set while inside a value
        self.in_key = False
        self.raw = ""  # the value so far, unstripped
        self.sent = ""  # the part of the stripped value already reported

    def _visible(self, final: bool) -> str:
        if not self.strip:
            return self.raw
        # Leading whitespace is never part of a stripped value; trailing whitespace may still be
        # followed by text, so it is held until the value closes.
        return self.raw.strip() if final else self.raw.lstrip().rstrip()

    def feed(self, text: str, out: list[Event]) -> None:
        self.buf += text
        while self.buf:
            if self.key is not None:
                j = self.buf.find(self.end)
                if j < 0:
                    keep = _partial_suffix(self.buf, [self.end])
                    self.raw += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep :]
                    self._report(out, final=False)
                    return
                self.raw += self.buf[:j]
                self.buf = self.buf[j + len(self.end) :]
                self._report(out, final=True)
                out.append(Event("param_close", self._visible(True), name=self.key))
                self.key = None
            elif self.in_key:
                j = self.buf.find(self.between)
                if j < 0:
                    return
                key, self.buf = self.buf[:j], self.buf[j + len(self.between) :]
                self.in_key = False
                if not key or '"' in key or "\n" in key:
                    out.append(Event("stray", self.begin + key + self.between))
                    continue
                self.key, self.raw, self.sent = key, "", ""
                out.append(Event("param_open", name=key))
            else:
                stripped = self.buf.lstrip()
                if not stripped:
                    self.buf = ""
                    return
                if stripped.startswith(self.begin):
                    self.buf, self.in_key = stripped[len(self.begin) :], True
                    continue
                if self.begin.startswith(stripped):
                    self.buf = stripped
                    return
                j = stripped.find("<", 1)
                j = len(stripped) if j < 0 else j
                out.append(Event("stray", stripped[:j]))
                self.buf = stripped[j:]

    def _report(self, out: list[Event], final: bool) -> None:
        visible = self._visible(final)
        if len(visible) > len(self.sent):
            out.append(Event("param_text", visible[len(self.sent) :]))
            self.sent = visible

    def finish(self, out: list[Event]) -> bool:
        """End of the call body; True if it was cut inside a parameter."""
        if self.key is not None:
            self.raw += self.buf
            out.append(Event("param_cut", name=self.key))
            return True
        if self.buf.strip():
            out.append(Event("stray", self.buf))
        return self.in_key


def _head(opener: str) -> str:
    m = CONTROL_TOKEN_RE.match(opener)
    return m.group(0) if m else opener.split("{")[0]


class MessageStream:
    """`prelude_is_content`: text before the first anchor is answer text (the tool parser reads
    what the reasoning parser hands over: answer text it already cleaned, then raw messages).
    `pause_at_call`: stop at the first tool-call header (the reasoning parser hands over there)."""

    OUTSIDE, HEADER, BODY, PAUSED = "outside", "header", "body", "paused"

    def __init__(self, t: ResponseTemplate, *, prelude_is_content: bool = False, pause_at_call: bool = False):
        self.t = t
        self.buf = ""
        self.state = self.OUTSIDE
        self.prelude = prelude_is_content
        self.pause_at_call = pause_at_call
        self.field: str | None = None
        self.header = ""
        self.args: _Arguments | None = None
        # How a message header can begin when its anchor is not in the output: its first
        # control token (`<|channel|>`), or its text up to the tool name (`to=`).
        self.header_starts = tuple(
            dict.fromkeys(
                _head(t.first_opener(o).lstrip())
                for o in t.thinking_openers + t.content_openers + t.call_openers
            )
        )
        self.closers = t.closers()
        self.message_token = t.header_end

    # -- feeding

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self.buf += text
        self._run(out, final=False)
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        self._run(out, final=True)
        if self.state == self.BODY:
            self._close(out)
        elif self.state == self.HEADER and self.buf:
            out.append(Event("stray", self.header + self.buf))  # a header cut by the end
        elif self.state == self.OUTSIDE and self.buf.strip():
            out.append(Event("content" if self.prelude else "stray", self.buf))
        self.buf = ""
        return out

    def hand_off(self) -> str:
        """The unread text from the paused call's header on, re-anchored so that another
        MessageStream (the tool parser's) reads that call from its start."""
        assert self.state == self.PAUSED
        rest = self.t.anchor + self.header.lstrip() + self.buf
        self.header = self.buf = ""
        return rest

    # -- the machine

    def _run(self, out: list[Event], final: bool) -> None:
        progress = True
        while progress and self.buf and self.state != self.PAUSED:
            progress = {self.OUTSIDE: self._outside, self.HEADER: self._header, self.BODY: self._body}[
                self.state
            ](out, final)

    def _outside(self, out: list[Event], final: bool) -> bool:
        t, buf = self.t, self.buf
        if self.prelude and buf.startswith(t.control_tokens):
            self.prelude = False  # raw output from its first token: nothing was handed over
        if self.prelude:
            j = buf.find(t.anchor)
            if j < 0:
                keep = 0 if final else _partial_suffix(buf, [t.anchor])
                if len(buf) > keep:
                    out.append(Event("content", buf[: len(buf) - keep]))
                self.buf = buf[len(buf) - keep :]
                return False
            if j:
                out.append(Event("content", buf[:j]))
            self.prelude, self.buf = False, buf[j:]
            return True
        stripped = buf.lstrip()
        if stripped.startswith(t.anchor):
            self.buf, self.state, self.header = stripped[len(t.anchor) :], self.HEADER, ""
            return True
        # A message without its anchor: the first one (the anchor is in the prompt), or a model
        # that dropped it; the header decides.
        if stripped.startswith(self.header_starts):
            self.buf, self.state, self.header = stripped, self.HEADER, ""
            return True
        if not final and any(s.startswith(stripped) for s in (t.anchor, *self.header_starts)):
            return False
        if not stripped:
            self.buf = ""
            return False
        j = stripped.find(CONTROL_TOKEN_PREFIX, 1)
        j = len(stripped) if j < 0 else j
        out.append(Event("stray", stripped[:j]))
        self.buf = stripped[j:]
        return True

    def _header(self, out: list[Event], final: bool) -> bool:
        buf = self.buf
        j = buf.find(self.message_token)
        broken = [k for k in (buf.find(c) for c in (*self.closers, self.t.anchor)) if k >= 0 and (j < 0 or k < j)]
        if broken:
            k = min(broken)
            out.append(Event("stray", self.header + buf[:k]))
            self.buf, self.state = buf[k:], self.OUTSIDE
            return True
        if j < 0:
            return False
        self.header += buf[: j + len(self.message_token)]
        self.buf = buf[j + len(self.message_token) :]
        self.field, name = self.t.classify_header(self.header)
        self.state = self.BODY
        if self.field == "tool_calls":
            out.append(Event("call_open", name=name))
            if self.pause_at_call:
                self.state = self.PAUSED
                return False
            self.args = _Arguments(self.t)
        return True

    def _body(self, out: list[Event], final: bool) -> bool:
        buf = self.buf
        hits = [(k, c) for c in self.t.control_tokens if (k := buf.find(c)) >= 0]
        if not hits:
            keep = 0 if final else _partial_suffix(buf, self.t.control_tokens)
            self._text(buf[: len(buf) - keep], out)
            self.buf = buf[len(buf) - keep :]
            return False
        k, token = min(hits)
        self._text(buf[:k], out)
        if token in self.closers:
            self.buf = buf[k + len(token) :]
            self._close(out)
        elif self.t.anchor.startswith(token) or token == _head(self.t.thinking_openers[0]):
            # A new message began without a closer: end this one where it stands.
            self.buf = buf[k:]
            self._close(out)
        else:
            out.append(Event("stray", token))
            self.buf = buf[k + len(token) :]
        return True

    def _text(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        if self.field == "thinking":
            out.append(Event("reasoning", text))
        elif self.field == "content":
            out.append(Event("content", text))
        elif self.field == "tool_calls":
            self.args.feed(text, out)
        else:
            out.append(Event("unknown", text))

    def _close(self, out: list[Event]) -> None:
        if self.field == "tool_calls":
            cut = self.args.finish(out)
            out.append(Event("call_close", cut=cut))
            self.args = None
        self.state, self.field, self.header = self.OUTSIDE, None, ""
