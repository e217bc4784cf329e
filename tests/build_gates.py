#!/usr/bin/env python3
"""The port image's build gates: eight checks, one line each (PASS / FAIL / SKIP and why).

    python3 tests/build_gates.py                       # in the port image (install.sh runs it)
    python3 tests/build_gates.py --profile v0.30.0-public-main --port-profile port-beam-1-0-public-main \\
        --root vllm=DIR --root vllm_gaudi=DIR --checkout vllm_gaudi=DIR   # a tree elsewhere

 1. fix profile applied      `fixes/apply_all.py --profile P --check` finds every fix applied and stamped
 2. port patches applied     the same for the port's profile (runner patches on top of P)
 3. plugin registered        the `vllm.general_plugins` entry point `beam_hpu:register` loads and runs
 4. vLLM registrations       BeamForCausalLM, `--load-format beam`, the `beam` reasoning and tool parsers
 5. BeamConfig               the published config's fields parse and validate
 6. template and parsers     the chat template renders a tool turn and the parsers read it back
 7. switches                 the environment's switches parse; the recipe's launch passes the guards
 8. bucket file              $COOKBOOK/ports/beam-1-0/serving/<file> of the recipe and of its draft
                             variants exist and lint (each variant at its drafts, the DFlash2 one with its
                             drafter block graphs, within the graph limit)

Gates 1-2 need a vllm-gaudi tree (installed, or --root vllm_gaudi=DIR): without one they SKIP
with the reason (the CPU proving ground). Exit 0 when no gate failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder leads sys.path, and its test packages (tests/fixes) would
# shadow the repository's own `fixes`.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(REPO) not in sys.path:
    # Last, for `fixes` and `serving` (not installed): an installed beam_hpu is the one checked.
    sys.path.append(str(REPO))

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
PORT_SERVING = Path("ports/beam-1-0/serving")

# The published Beam-1.0-501B-A23B config.json fields (REFERENCE.md: transformers' BeamConfig
# defaults are the checkpoint's); gate 5 checks BeamConfig takes them as given.
PUBLISHED_CONFIG = {
    "model_type": "beam",
    "vocab_size": 151936,
    "hidden_size": 5120,
    "num_hidden_layers": 52,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 20480,
    "moe_intermediate_size": 2560,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "sliding_window": 512,
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 or i == 51 else "sliding_attention" for i in range(52)],
    "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 49,
}


class Skip(Exception):
    """The gate cannot run here; the message says why."""


@dataclass
class Result:
    number: int
    name: str
    status: str
    why: str

    def line(self) -> str:
        return f"gate {self.number} {self.name}: {self.status}: {self.why}"


def _pairs(values: list[str]) -> dict[str, str]:
    out = {}
    for value in values:
        module, sep, directory = value.partition("=")
        if not sep:
            raise SystemExit(f"expected PACKAGE=DIR, got {value!r}")
        out[module] = directory
    return out


def _profile_check(name: str, roots: dict[str, str], checkouts: dict[str, str]) -> str:
    from fixes.engine import ALREADY, run
    from fixes.image import ImageError, locate_root
    from fixes.profile import load_profile

    profile = load_profile(name)
    for module in profile.packages:
        try:
            locate_root(module, roots.get(module))
        except ImageError as e:
            if module == "vllm_gaudi":
                raise Skip(f"no vllm-gaudi tree here ({e}); the image has one") from None
            raise
    report = run(profile, roots=roots, checkouts=checkouts, check=True)
    if report.exit_code != 0:
        bad = [line for line in report.lines if not line.startswith("image:") and ALREADY not in line]
        raise AssertionError(f"--check exit {report.exit_code}: " + "; ".join(bad))
    return f"{len(report.states)} fixes applied and stamped ({name})"


def gate_plugin() -> str:
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group="vllm.general_plugins") if e.value == "beam_hpu:register"]
    if not found:
        raise AssertionError("no vllm.general_plugins entry point beam_hpu:register (pip install the repo)")
    register = found[0].load()
    register()
    register()  # idempotent: vLLM calls it in every process, sometimes twice
    import beam_hpu

    return f"entry point {found[0].name!r} -> beam_hpu:register ran ({Path(beam_hpu.__file__).parent})"


def gate_registrations() -> str:
    import beam_hpu
    from beam_hpu.names import ARCH
    from vllm import ModelRegistry
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    beam_hpu.register()
    problems = []
    if ARCH not in ModelRegistry.get_supported_archs():
        problems.append(f"{ARCH} is not a registered architecture")
    from vllm.model_executor import model_loader

    if "beam" not in model_loader._LOAD_FORMAT_TO_MODEL_LOADER:  # register_model_loader's table
        problems.append("--load-format beam is not registered (beam_hpu.loader is not part of this build)")
    if "beam" not in ReasoningParserManager.lazy_parsers and "beam" not in ReasoningParserManager.reasoning_parsers:
        problems.append("reasoning parser beam is not registered")
    if "beam" not in ToolParserManager.lazy_parsers and "beam" not in ToolParserManager.tool_parsers:
        problems.append("tool parser beam is not registered")
    if problems:
        raise AssertionError("; ".join(problems))
    ReasoningParserManager.get_reasoning_parser("beam")
    ToolParserManager.get_tool_parser("beam")
    return f"{ARCH}, --load-format beam, reasoning and tool parser beam (both import)"


def gate_config() -> str:
    from beam_hpu.model.config import beam_config_class, validate_beam_config

    fields = {k: v for k, v in PUBLISHED_CONFIG.items() if k != "model_type"}
    cfg = beam_config_class()(**fields)
    validate_beam_config(cfg)
    wrong = [k for k, v in fields.items() if getattr(cfg, k, None) != v]
    if wrong:
        raise AssertionError(f"BeamConfig changed the published fields {wrong}")
    if cfg.model_type != "beam":
        raise AssertionError(f"BeamConfig.model_type is {cfg.model_type!r}")
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    return f"{len(fields)} published fields kept; full attention on layers {full}, window {cfg.sliding_window}"


def gate_template_and_parsers() -> str:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # only for importing vLLM's request types
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager

    import beam_hpu.parsers
    from beam_hpu.tiny.checkpoint import write_tokenizer

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}}
    user = [{"role": "user", "content": "Weather in Paris?"}]
    turns = {
        "tool call": ({"role": "assistant", "reasoning_content": "Need the weather.", "content": None,
                       "tool_calls": [{"id": "c1", "type": "function", "function": {
                           "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
                      ("Need the weather.", None, [("get_weather", {"city": "Paris", "days": 2})])),
        "answer": ({"role": "assistant", "reasoning_content": "Easy.", "content": "Sunny."},
                   ("Easy.", "Sunny.", [])),
    }
    with tempfile.TemporaryDirectory() as d:
        write_tokenizer(Path(d))  # the checkpoint's chat template and response_template
        tokenizer = AutoTokenizer.from_pretrained(d)
    beam_hpu.parsers.register()
    parser_cls = ParserManager.get_parser(tool_parser_name="beam", reasoning_parser_name="beam",
                                          enable_auto_tools=True)
    request = ChatCompletionRequest(model="beam", messages=user, tools=[tool])
    prompt = tokenizer.apply_chat_template(user, tools=[tool], tokenize=False, add_generation_prompt=True)
    import json

    for kind, (turn, (reasoning, content, calls)) in turns.items():
        full = tokenizer.apply_chat_template(user + [turn], tools=[tool], tokenize=False)
        if not full.startswith(prompt):
            raise AssertionError(f"{kind}: the rendered history does not extend the generation prompt")
        output = full[len(prompt):]
        for stop in ("<|call|>", "<|return|>", "<|end|>"):  # the stop token is not in the output text
            output = output.removesuffix(stop)
        parser = parser_cls(tokenizer, request.tools, chat_template_kwargs={})
        got_reasoning, got_content, got_calls = parser.parse(output, request, enable_auto_tools=True)
        got = (got_reasoning, got_content or None,
               [(c.name, json.loads(c.arguments)) for c in got_calls or []])
        if got != (reasoning, content, calls):
            raise AssertionError(f"{kind}: rendered {output!r}, parsers read {got}")
    return "a tool-call turn and an answer turn render and parse back to reasoning, call and content"


def gate_switches() -> str:
    from beam_hpu.settings.guards import check_startup
    from beam_hpu.settings.switches import SWITCHES, read_switches
    from serving.recipe import flags_as_vllm_args, load_recipe, recipe_flags

    here = read_switches(os.environ)
    recipe = load_recipe()
    env = {k: str(v) for k, v in recipe["env"].items()}
    check_startup(env, flags_as_vllm_args(recipe_flags(recipe)), device_type="hpu")
    missing = sorted(set(SWITCHES) - set(env) - {"BEAM_ALLOW_EAGER"})
    if missing:
        raise AssertionError(f"the recipe does not set {missing}")
    set_here = sorted(k for k in SWITCHES if k in os.environ)
    return (f"{len(here)} switches parse (set here: {', '.join(set_here) or 'none'}); "
            "the recipe's env and flags pass the startup guards on HPU")


def gate_buckets(cookbook: Path) -> str:
    """The recipe's bucket file and the draft variants', each linted for its own launch (a variant's
    at its num_speculative_tokens, with its drafter's block graphs if it has any, against the same
    graph limit)."""
    from serving.lint_buckets import DRAFT_VARIANTS, drafts_in_block_graphs, lint_bucket_text, speculative_tokens
    from serving.recipe import load_recipe, recipe_geometry

    recipe = load_recipe()
    linted = []
    launches = [("recipe", recipe, 0, False)] + [
        (f"{variant} variant", recipe[variant], speculative_tokens(recipe, variant),
         drafts_in_block_graphs(recipe, variant)) for variant in DRAFT_VARIANTS]
    for where, section, k, drafter in launches:
        path = cookbook / PORT_SERVING / section["buckets"]["file"]
        expected = section["env"]["VLLM_BUCKETING_FROM_FILE"]
        if not str(expected).endswith(str(PORT_SERVING / section["buckets"]["file"])):
            raise AssertionError(f"the {where}'s VLLM_BUCKETING_FROM_FILE {expected} is not {PORT_SERVING}/...")
        if not path.is_file():
            raise AssertionError(f"{path} does not exist (the {where}'s VLLM_BUCKETING_FROM_FILE)")
        problems = lint_bucket_text(path.read_text(), recipe_geometry(recipe), k, drafter_graphs=drafter)
        if problems:
            raise AssertionError(f"{path}: {len(problems)} problems, first: {problems[0]}")
        linted.append(f"{path.name} ({where}{f', {k} drafts' if k else ''})")
    return f"{', '.join(linted)} lint against the recipe's flags"


def run_gates(args) -> list[Result]:
    roots, checkouts = _pairs(args.root), _pairs(args.checkout)
    cookbook = Path(args.cookbook or os.environ.get("COOKBOOK") or REPO)
    gates: list[tuple[str, Callable[[], str]]] = [
        ("fix profile applied", lambda: _profile_check(args.profile, roots, checkouts)),
        ("port patches applied", lambda: _profile_check(args.port_profile, roots, checkouts)),
        ("plugin registered", gate_plugin),
        ("vLLM registrations", gate_registrations),
        ("BeamConfig", gate_config),
        ("template and parsers", gate_template_and_parsers),
        ("switches", gate_switches),
        ("bucket file", lambda: gate_buckets(cookbook)),
    ]
    results = []
    for number, (name, gate) in enumerate(gates, 1):
        try:
            results.append(Result(number, name, PASS, gate()))
        except Skip as e:
            results.append(Result(number, name, SKIP, str(e)))
        except Exception as e:  # noqa: BLE001  (a gate reports whatever stopped it)
            why = str(e).strip() or type(e).__name__
            if args.verbose:
                traceback.print_exc()
            results.append(Result(number, name, FAIL, f"{type(e).__name__}: {why}"))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The beam-1-0 port's build gates.")
    parser.add_argument("--profile", default="v0.30.0", help="the fix profile (default v0.30.0)")
    parser.add_argument("--port-profile", default="port-beam-1-0", help="the port's profile")
    parser.add_argument("--root", action="append", default=[], metavar="PACKAGE=DIR")
    parser.add_argument("--checkout", action="append", default=[], metavar="PACKAGE=DIR")
    parser.add_argument("--cookbook", help="where the repository sits in the image (default $COOKBOOK, else here)")
    parser.add_argument("-v", "--verbose", action="store_true", help="tracebacks of failed gates")
    args = parser.parse_args(argv)
    results = run_gates(args)
    for result in results:
        print(result.line(), flush=True)
    failed = [r for r in results if r.status == FAIL]
    passed = sum(r.status == PASS for r in results)
    skipped = sum(r.status == SKIP for r in results)
    print(f"build gates: {passed}/{len(results)} passed, {skipped} skipped, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
