"""Every switch of the Beam port in one place: default, parser, description; and its one reader.

Each switch has a default (the value the verified recipe runs with, so a launch without the env
block behaves like the recipe), a parser that refuses anything it does not understand with an
error naming the variable, and a one-paragraph description; the port README is generated from,
and checked against, these descriptions. Code that acts on a switch reads it with `current()`
(per call: tests and benchmarks flip switches inside one process); the launch guards
(`beam_hpu.settings.guards`) read them all at once with `read_switches()`.

Plain functions only: nothing here imports vLLM or torch.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# Query buckets grow in steps of the KV block size (128 on HPU); a tile that is a multiple of it
# splits every bucket into whole tiles.
FSDPA_Q_TILE_STEP = 128
# Gaudi 2 carries 96 GB of HBM per card: a workspace bound at or above it bounds nothing.
GAUDI2_HBM_GIB = 96
# difflib similarity from which an unknown BEAM_* name is taken for a misspelt switch.
MISSPELLING_CUTOFF = 0.85


class SwitchError(ValueError):
    """A switch's value cannot be used; the message names the variable."""


@dataclass(frozen=True)
class Switch:
    name: str
    default: str  # as it would be written in the environment
    parse: Callable[[str, str], Any]  # (name, text) -> value; raises SwitchError
    description: str

    def read(self, env: Mapping[str, str]) -> Any:
        return self.parse(self.name, env.get(self.name, self.default))


def parse_bool(name: str, text: str) -> bool:
    # Strict on purpose: vllm-gaudi's own `boolean()` reads "2" or "ture" as False without a word.
    value = text.strip().lower()
    if value in ("1", "true"):
        return True
    if value in ("0", "false"):
        return False
    raise SwitchError(f"{name}={text!r}: expected 1 or 0 (true/false)")


def parse_gib(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise SwitchError(f"{name}={text!r}: expected a number of GiB, e.g. 2") from None
    if not math.isfinite(value) or value < 0 or value >= GAUDI2_HBM_GIB:
        raise SwitchError(
            f"{name}={text!r}: expected 0 (no bound) or a bound in GiB below the card's "
            f"{GAUDI2_HBM_GIB} GiB, e.g. 2"
        )
    return value


def parse_q_tile(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise SwitchError(f"{name}={text!r}: expected an integer number of query rows") from None
    if value < 0 or value % FSDPA_Q_TILE_STEP:
        raise SwitchError(
            f"{name}={text!r}: expected 0 (no tiling) or a positive multiple of "
            f"{FSDPA_Q_TILE_STEP} (the query bucket step), e.g. 256"
        )
    return value


def parse_token_limit(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise SwitchError(f"{name}={text!r}: expected a whole number of tokens (0 = off), e.g. 1") from None
    if value < 0:
        raise SwitchError(f"{name}={text!r}: expected 0 (off) or a positive number of tokens, e.g. 1")
    return value


def _switches(*switches: Switch) -> dict[str, Switch]:
    return {s.name: s for s in switches}


SWITCHES: dict[str, Switch] = _switches(
    Switch(
        "BEAM_EXACT_ROUNDING",
        "0",
        parse_bool,
        "Rounding of the dynamic per-token FP8 activation quantisation "
        "(beam_hpu.quant.rounding.per_token_fp8). 1: as the per-token FP8 reference rounds: scale "
        "= amax / FP8 max in fp32, x / scale, to nearest, ties to even. 0: as vllm-gaudi's "
        "dynamic_quant, what the recipe runs: scale = (amax + 1e-8) / FP8 max in the activation's "
        "dtype, x times the scale's reciprocal, to nearest even, saturated. Readers and limits: "
        "beam_hpu/runtime/fp8/README.md.",
    ),
    Switch(
        "BEAM_PREFILL_INFLIGHT",
        "1",
        parse_bool,
        "Whether running decodes stay in flight while a prompt prefills. 1 (runtime patch "
        "prefill-inflight, for an engine serving Beam): running decodes are scheduled first, so "
        "each gets its token in every step that carries a prefill chunk, and the prompt, not the "
        "decodes, pays for a full KV pool. 0: vLLM's admission order, in which an "
        "earlier-admitted prompt takes the budget first and preempts decodes to grow.",
    ),
    Switch(
        "BEAM_FSDPA_WS_GIB",
        "2",
        parse_gib,
        "Upper bound, in GiB per card, on the modelled workspace of one FusedSDPA call in Beam's "
        "prompt attention with cached context (chunked prefill, prefix-cache hits); the port "
        "patch beam-fsdpa-tiles makes the stock single call where it fits and splits only a chunk "
        "that does not into query tiles under it. 0: no bound, one call per chunk as stock "
        "vllm-gaudi, refused with --max-model-len of 32768 or more. Other prefill, decode and "
        "other models are not affected.",
    ),
    Switch(
        "BEAM_FSDPA_Q_TILE",
        "256",
        parse_q_tile,
        "Query rows per FusedSDPA call in Beam's prompt attention with cached context (port patch "
        "beam-fsdpa-tiles) for a chunk whose single call does not fit BEAM_FSDPA_WS_GIB (not 0); a "
        "tile gets fewer rows when that bound or FusedSDPA's bias-plane limit (2**31 bytes) "
        "requires. 0: no fixed tile, the fewest tiles that fit; otherwise a multiple of 128, the "
        "query bucket step, so every bucket splits into whole tiles.",
    ),
    Switch(
        "BEAM_GRAMMAR_DEVICE_MASK",
        "1",
        parse_bool,
        "Where structured-output steps apply xgrammar's packed token bitmask. 1: on the logits' "
        "own device (port unit beam-grammar-device-mask); the logits never leave it. 0: "
        "vllm-gaudi's stock path, a device-to-host round trip of the logits on every structured "
        "step; with VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUT=1 every step with a chat request is one.",
    ),
    Switch(
        "BEAM_MOE_GATHER",
        "0",
        parse_token_limit,
        "The largest token count T of a step whose routed FP8 experts take the gathered path "
        "(port unit beam-moe-gather on HPU, the portable experts on CPU); 0 = off. Such a step "
        "computes only the G = min(local experts, T x top-k) experts it routes to; larger steps, "
        "and other models, call vllm-gaudi's fused op. Off in the recipe (its gain is a model, not "
        "measured); 1, the opt-in serving/launch-moe-gather.sh: batch-1 decode reads 8 of a card's "
        "32 experts per MoE layer.",
    ),
    Switch(
        "BEAM_WINDOW_KV",
        "0",
        parse_bool,
        "1: a window-sized KV cache for Beam's 43 sliding-window layers on HPU (the three port "
        "units beam-window-kv-*): vLLM's KV-cache manager forms 1 full + 5 sliding groups, and a "
        "token costs the 9 full layers' K/V instead of 52 layers' (about 5.7x the KV pool). 0: "
        "vllm-gaudi's stock cache, full-context K/V for every layer. Beam only; off in the recipe "
        "until a card run confirms it.",
    ),
    Switch(
        "VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUT",
        "1",
        parse_bool,
        "1: every output of the beam parsers is generated under the grammar derived from the "
        "checkpoint's response template, from the first token (reasoning included), also for "
        "requests without tools or a response_format; this is what keeps long agentic tool "
        "calls well formed. 0: only requests with a forced (required or named) or forbidden "
        "(none) tool choice, or an answer format, are constrained; free turns (tools with auto "
        "included) are not, which frees them: the always-on grammar costs about 10% of aggregate "
        "throughput at 8 to 16 concurrent chat requests. Same name and default as upstream "
        "vLLM's Beam support.",
    ),
    Switch(
        "VLLM_BEAM_STREAM_TOOL_ARGS",
        "1",
        parse_bool,
        "1: the beam tool parser streams a tool call's arguments while they are generated "
        "(the name first, then argument deltas), the way vLLM's Qwen3-XML parser streams "
        "string values. 0: upstream vLLM's behaviour, each call sent whole when it closes. "
        "Known issue with 1: a call cut off by max_tokens inside a streamed string argument "
        "leaves the client with argument text that does not parse.",
    ),
    Switch(
        "BEAM_ALLOW_EAGER",
        "0",
        parse_bool,
        "1 lets --enforce-eager start on HPU, which the port otherwise refuses: eager decode "
        "is bound by host op launches at 0.68 tokens/s, against about 29 tokens/s with the "
        "decode graphs. Only for debugging a graph-capture problem; not part of the recipe.",
    ),
)


def is_port_switch_name(name: str) -> bool:
    return name.startswith(("BEAM_", "VLLM_BEAM_"))


def read_switch(name: str, env: Mapping[str, str]) -> Any:
    try:
        switch = SWITCHES[name]
    except KeyError:
        raise SwitchError(f"{name} is not a switch of the Beam port") from None
    return switch.read(env)


def read_switches(env: Mapping[str, str]) -> dict[str, Any]:
    """Every switch's value; one SwitchError listing every bad or unknown BEAM_* variable."""
    values, problems = {}, []
    for name, switch in SWITCHES.items():
        try:
            values[name] = switch.read(env)
        except SwitchError as e:
            problems.append(str(e))
    # A misspelt switch would otherwise leave its default in force without a word. Only names
    # close to a switch are refused: other BEAM_* variables (test harness knobs) are not ours.
    for name in sorted(env):
        if is_port_switch_name(name) and name not in SWITCHES:
            close = difflib.get_close_matches(name, SWITCHES, n=1, cutoff=MISSPELLING_CUTOFF)
            if close:
                problems.append(f"{name} is not a switch of the Beam port; did you mean {close[0]}?")
    if problems:
        raise SwitchError("; ".join(problems))
    return values


def current(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The value of switch `name` in `env` (default: this process's environment, read now)."""
    return read_switch(name, os.environ if env is None else env)
