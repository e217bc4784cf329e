"""Client text stays text: no string a client sends can become a control token in the prompt.

The threat: vLLM renders a chat request to prompt *text* with the chat template, then tokenizes
that text with the tokenizer's added tokens recognised anywhere. A message, a tool result, a tool
description or a tool name holding `<|end|><|start|>system<|message|>...` therefore closed its turn
and forged another. On the node the chat template is the checkpoint's, not ours, so
nothing here relies on what a template does with the text.

Chosen: render with client text neutralised, then tokenize per segment.
1. Before rendering, every string the client supplied (messages at any depth: content, content
   parts, names, ids, tool-call arguments, `reasoning`; the tool list: names, descriptions, JSON
   schema keys and strings; chat-template kwargs) has each character that begins or ends one of
   the tokenizer's added tokens (`<`, `>` for Beam) replaced by a private-use character absent
   from the request and the template. Client text then cannot hold an added token, nor begin or
   end one that the template text around it completes.
2. The rendered text is split at the added tokens it holds: all of them are the template's. Each
   text segment between them gets its private-use characters put back and is encoded as ordinary
   text (normalizer, pre-tokenizer, BPE model: never the added-token matcher), so the model sees
   the client's characters, `<`, `|`, `end`, `|>`, never the control token.
3. The prompt goes on as token ids (vLLM accepts ids from the template step).

Why not the alternatives: escaping (say a zero-width space after `<`) changes the characters the
model reads and what a tool result means; a 400 for any control-token text lets anyone who can
put `<|end|>` on a web page break every agent that reads it. Rendering per message would need to
know the template's layout, which is the checkpoint's.

What is left: a template that builds an added token out of client text with template characters
on both sides (`<|{{ role }}|>`) could still form one. Beam's template does not (`<|start|>` +
role + `<|message|>`), and roles and tool names are checked before rendering (validation.py), so
the only client strings such a template could splice are already restricted to known roles and
`[A-Za-z0-9_.-]` names. A request with none of the neutralised characters in its client strings
takes vLLM's own path unchanged (the text is rendered and tokenized as before).

The parsers read the model's output, never the client's text; the response grammar keeps
control-token strings out of free text (grammar.py), so spelled-out markup cannot appear there.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from beam_hpu.parsers.template import ResponseTemplateError, response_template_of
from beam_hpu.parsers.validation import check_conversation, check_tools

logger = logging.getLogger("vllm.beam_hpu.parsers")

_PRIVATE_USE = range(0xE000, 0xF900)


@dataclass(frozen=True)
class AddedTokens:
    """The tokenizer's added tokens: what the added-token matcher would find in prompt text."""

    ids: dict[str, int]
    pattern: re.Pattern  # leftmost-longest match of any added token
    edge_chars: frozenset[str]  # first and last characters of every added token

    def encode(self, tokenizer, rendered: str, restore: dict[int, str] | None = None) -> list[int]:
        """Token ids of `rendered`: its added tokens as themselves, the text between them as
        ordinary text (with `restore` applied first)."""
        ids: list[int] = []
        at = 0
        for m in self.pattern.finditer(rendered):
            if m.start() > at:
                ids += encode_as_text(tokenizer, _restored(rendered[at : m.start()], restore))
            ids.append(self.ids[m.group(0)])
            at = m.end()
        if at < len(rendered):
            ids += encode_as_text(tokenizer, _restored(rendered[at:], restore))
        return ids


def _restored(text: str, restore: dict[int, str] | None) -> str:
    return text.translate(restore) if restore else text


def added_tokens(tokenizer) -> AddedTokens:
    vocab = {t: i for t, i in tokenizer.get_added_vocab().items() if t}
    alternation = "|".join(re.escape(t) for t in sorted(vocab, key=len, reverse=True))
    edges = frozenset(c for t in vocab for c in (t[0], t[-1]))
    return AddedTokens(vocab, re.compile(alternation or r"(?!)"), edges)


def encode_as_text(tokenizer, text: str) -> list[int]:
    """`text` as ordinary text: the backend's normalizer, pre-tokenizer and model, without its
    added-token matcher. Stateless (the `split_special_tokens` switch of transformers flips a flag
    on the shared backend, which concurrent renders would race on, and spares non-special added
    tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise RuntimeError(
            f"beam: the tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no fast backend "
            "(tokenizer.json); client text cannot be encoded as plain text without it"
        )
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    pieces = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str(text)] if backend.pre_tokenizer else [text]
    return [token.id for piece in pieces for token in backend.model.tokenize(piece)]


# ---------------------------------------------------------------------------------------------
# Neutralising client strings


def client_strings(value):
    """Every string in a JSON-like value, mapping keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                yield k
            yield from client_strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from client_strings(v)


def neutralised(value, table: dict[int, str]):
    """A copy of a JSON-like value with `table` applied to every string, keys included."""
    if isinstance(value, str):
        return value.translate(table)
    if isinstance(value, dict):
        return {(k.translate(table) if isinstance(k, str) else k): neutralised(v, table) for k, v in value.items()}
    if isinstance(value, list):
        return [neutralised(v, table) for v in value]
    if isinstance(value, tuple):
        return tuple(neutralised(v, table) for v in value)
    return value


def placeholder_table(edge_chars, taken: str) -> dict[int, str]:
    """{ord(edge char): a private-use character found nowhere in `taken`}."""
    free = (chr(c) for c in _PRIVATE_USE if chr(c) not in taken)
    return {ord(c): next(free) for c in sorted(edge_chars)}


# ---------------------------------------------------------------------------------------------
# The hook: vllm.renderers.hf.safe_apply_chat_template, the one place vLLM 0.30.0 renders a chat
# request for an HF tokenizer (chat completions, responses, /tokenize)


_beam_tokenizers: dict[int, tuple[object, AddedTokens | None]] = {}


def beam_added_tokens(tokenizer) -> AddedTokens | None:
    """The added tokens of a Beam tokenizer (one that carries a response template); None for any
    other model served with the plugin installed, which is left alone."""
    cached = _beam_tokenizers.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    try:
        response_template_of(tokenizer)
        found = added_tokens(tokenizer)
    except ResponseTemplateError:
        found = None
    _beam_tokenizers[id(tokenizer)] = (tokenizer, found)
    return found


def render_untrusted(original, model_config, tokenizer, conversation, *, tools=None, chat_template=None,
                     tokenize=True, return_assistant_tokens_mask=False, **kwargs):
    """`original` (vLLM's safe_apply_chat_template) with the guarantee above for Beam tokenizers."""
    vocab = beam_added_tokens(tokenizer)
    if vocab is None:
        return original(model_config, tokenizer, conversation, tools=tools, chat_template=chat_template,
                        tokenize=tokenize, return_assistant_tokens_mask=return_assistant_tokens_mask, **kwargs)
    check_conversation(conversation)
    check_tools(tools)
    client = (conversation, tools, kwargs)
    hostile = any(c in s for s in client_strings(client) for c in vocab.edge_chars)
    if not hostile:
        return original(model_config, tokenizer, conversation, tools=tools, chat_template=chat_template,
                        tokenize=tokenize, return_assistant_tokens_mask=return_assistant_tokens_mask, **kwargs)
    templates = [t for t in (chat_template, getattr(tokenizer, "chat_template", None)) if isinstance(t, str)]
    taken = "".join([*client_strings(client), *templates])
    table = placeholder_table(vocab.edge_chars, taken)
    rendered = original(model_config, tokenizer, neutralised(conversation, table), tools=neutralised(tools, table),
                        chat_template=chat_template, tokenize=False, **neutralised(kwargs, table))
    ids = vocab.encode(tokenizer, rendered, {ord(p): chr(c) for c, p in table.items()})
    return (ids, None) if return_assistant_tokens_mask else ids
