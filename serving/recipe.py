"""The recipe's values as data: `recipe.yaml`, and the launch block of a shell script or of the
published recipe text (`export NAME=VALUE` lines, the fix step, and the `vllm serve` command).

The bucket generator and linter take their launch geometry from here, so the bucket file and
the flags it must cover come from one place.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

SERVING_DIR = Path(__file__).resolve().parent
RECIPE_PATH = SERVING_DIR / "recipe.yaml"


@dataclass(frozen=True)
class Geometry:
    """The launch values a bucket file must cover."""

    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_batch_size: int
    sliding_window: int
    max_decode_graphs: int


def window_kv_file_name(file_name: str) -> str:
    """The bucket file for a window-sized KV cache beside `file_name`:
    tp8-seqs16-256k.txt -> tp8-seqs16-256k-window.txt."""
    stem, dot, ext = file_name.rpartition(".")
    return f"{stem}-window{dot}{ext}"


def load_recipe(path: Path = RECIPE_PATH) -> dict:
    import yaml  # only the recipe needs it; the bucket linter itself does not

    with open(path) as f:
        return yaml.safe_load(f)


def recipe_geometry(recipe: dict) -> Geometry:
    serve, buckets = recipe["serve"], recipe["buckets"]
    return Geometry(
        block_size=int(serve["block-size"]),
        max_model_len=int(serve["max-model-len"]),
        max_num_seqs=int(serve["max-num-seqs"]),
        max_num_batched_tokens=int(serve["max-num-batched-tokens"]),
        max_prefill_batch_size=int(buckets["max_prefill_batch_size"]),
        sliding_window=int(buckets["sliding_window"]),
        max_decode_graphs=int(buckets["max_decode_graphs"]),
    )


@dataclass
class LaunchBlock:
    env: dict[str, str] = field(default_factory=dict)
    model: str | None = None
    flags: dict[str, str | bool] = field(default_factory=dict)  # "--flag" -> value, True if bare
    extra_args: list[str] = field(default_factory=list)  # e.g. "$@" in a script
    fix_profile: str | None = None


def _logical_lines(text: str):
    pending = ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        yield (pending + line).strip()
        pending = ""
    if pending:
        yield pending.strip()


def parse_launch_block(text: str) -> LaunchBlock:
    """Env exports, fix profile and `vllm serve` flags of a launch block; prose is ignored."""
    block = LaunchBlock()
    for line in _logical_lines(text):
        if line.startswith("export "):
            for word in shlex.split(line)[1:]:
                name, sep, value = word.partition("=")
                if sep:
                    block.env[name] = value
        elif line.startswith("python") and "fixes/apply_all.py" in line:
            words = shlex.split(line.split("||")[0])
            if "--profile" in words:
                block.fix_profile = words[words.index("--profile") + 1]
        elif line.startswith(("vllm serve ", "exec vllm serve ")):
            # posix=False keeps "$MODEL" and "$@" quoted, so they read as what they are.
            words = shlex.split(line.split(" #")[0], posix=False)
            _parse_serve(words[words.index("serve") + 1 :], block)
    return block


def _parse_serve(words: list[str], block: LaunchBlock) -> None:
    block.model = words[0].strip('"')
    rest = words[1:]
    i = 0
    while i < len(rest):
        word = rest[i]
        if not word.startswith("--"):
            block.extra_args.append(word)
            i += 1
            continue
        name, sep, value = word.partition("=")
        if sep:
            block.flags[name] = value
            i += 1
        elif i + 1 < len(rest) and not rest[i + 1].startswith(("--", '"$')):
            block.flags[name] = rest[i + 1]
            i += 2
        else:
            block.flags[name] = True
            i += 1


def recipe_flags(recipe: dict) -> dict[str, str | bool]:
    """recipe.yaml's serve section as launch-block flags ("--name" -> text, or True if bare)."""
    return {f"--{name}": (True if value is True else str(value)) for name, value in recipe["serve"].items()}


def flags_as_vllm_args(flags: dict[str, str | bool]) -> dict[str, object]:
    """Flags under vLLM's argument names, numbers as ints, for `beam_hpu.settings.guards.check_startup`."""
    args: dict[str, object] = {}
    for flag, value in flags.items():
        name = flag.lstrip("-").replace("-", "_")
        args[name] = int(value) if isinstance(value, str) and value.isdigit() else value
    return args
