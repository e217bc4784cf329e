"""Serving the tiny Beam on CPU: the `vllm serve` command line of the demo and of every replica
(`beam_hpu.replicas`), its environment, the checkpoint it serves, and the `beam-hpu tiny` /
`beam-hpu demo` commands (`beam_hpu.cli` parses their arguments and calls them).

`demo` is the project's main job on a machine without Gaudi: it writes a tiny Beam checkpoint (by
default the committed tiny trained Beam, which reasons briefly, answers and calls tools) and
serves it with `vllm serve`, using every flag of the recipe's launch block that means something on
CPU (see `serve_command`), so the same plugin, model and parsers run as on the Gaudi node.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from beam_hpu.names import LOAD_FORMAT, PARSER

DEFAULT_DEMO_DIR = Path(".beam-hpu/tiny-demo")
# Random-weight presets of beam_hpu.tiny.checkpoint; "trained" on the command line means the trained weights.
PRESET_NAMES = ["small", "wide"]
SERVED_NAME = "beam-tiny"


def serve_command(model_dir: str | Path, *, port: int = 8000, tp: int = 1, ep: bool = False,
                  max_model_len: int = 4096, extra: list[str] | None = None) -> list[str]:
    """`vllm serve` for a tiny Beam on CPU, flag for flag from the Gaudi recipe where it applies.

    Kept from the recipe: --dtype bfloat16, --block-size 128, --max-num-seqs 16,
    --max-num-batched-tokens 4096, --enable-prefix-caching, --enable-prompt-tokens-details,
    --enable-expert-parallel (with --ep), --load-format beam and the `beam` parsers.
    Changed for CPU, and why: --enforce-eager (the recipe forbids it on HPU because eager decode
    is host-bound there; on CPU it only skips a minutes-long inductor compile of a tiny model);
    --max-model-len 4096 (the tiny model's positions); no --gpu-memory-utilization (CPU sizes the
    KV cache from VLLM_CPU_KVCACHE_SPACE); no --async-scheduling and no
    --max-cudagraph-capture-size (vLLM's CPU platform turns both off).
    """
    vllm = shutil.which("vllm", path=os.path.dirname(sys.executable)) or "vllm"
    cmd = [
        vllm, "serve", str(model_dir),
        "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--tensor-parallel-size", str(tp),
        "--dtype", "bfloat16",
        "--block-size", "128",
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", "16",
        "--max-num-batched-tokens", "4096",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--enforce-eager",
    ]
    if ep:
        cmd.append("--enable-expert-parallel")
    # The port's loader and parsers, as in the recipe.
    cmd += ["--load-format", LOAD_FORMAT,
            "--reasoning-parser", PARSER, "--enable-auto-tool-choice", "--tool-call-parser", PARSER]
    return cmd + list(extra or [])


def serve_env(tp: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; plenty for a tiny model
    if tp > 1:
        # One NUMA node and 2 cores here: vLLM needs an explicit CPU list per rank.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp)))
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return env


def write_checkpoint(out, preset: str, dtype: str, seed: int, fp8: bool):
    """A tiny Beam; with `fp8`, quantised as the published checkpoint is (compressed-tensors FP8).

    `trained` is the committed tiny trained Beam (`beam_hpu.tiny.train`): it answers, calls tools
    and copies, so the demo's replies mean something; its weights are fixed (bf16), `seed` and
    `dtype` do not apply. The other presets are random weights of that seed."""
    if preset == "trained":
        import shutil

        from beam_hpu.tiny.checkpoint import TRAINED_DIR

        if fp8:
            from beam_hpu.quant.fp8_checkpoint import quantize_checkpoint

            return quantize_checkpoint(TRAINED_DIR, out)
        shutil.copytree(TRAINED_DIR, out, dirs_exist_ok=True)
        return Path(out)
    if fp8:
        from beam_hpu.tiny.fp8_checkpoint import write_tiny_fp8_checkpoint

        return write_tiny_fp8_checkpoint(out, preset, seed=seed)
    from beam_hpu.tiny.checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(out, preset, dtype=dtype, seed=seed)


def tiny_command(args) -> int:
    if args.preset == "trained" and (args.dtype != "bfloat16" or args.seed != 0):
        # The trained weights are fixed; a silently different checkpoint would be worse than a refusal.
        raise SystemExit("beam-hpu tiny: --preset trained writes the committed bf16 weights; "
                         "--dtype and --seed do not apply (leave them at bfloat16 / 0)")
    out = write_checkpoint(args.dir, args.preset, args.dtype, args.seed, args.fp8)
    kind = "FP8" if args.fp8 else args.dtype
    print(f"wrote tiny Beam ({args.preset}, {kind}, seed {args.seed}) to {out}")
    return 0


def draft_arguments(draft: str | None) -> list[str] | None:
    """`vllm serve` arguments of `beam-hpu demo --draft DRAFT`: the committed tiny drafter's
    `--speculative-config` (eagle3 or dflash2), or None without --draft."""
    if draft is None:
        return None
    if draft == "dflash2":
        from beam_hpu.tiny.dflash2_drafter import speculative_config
    else:
        from beam_hpu.tiny.drafter import speculative_config
    return ["--speculative-config", speculative_config()]


def demo_command(args) -> int:
    """`beam-hpu demo` with one server (`--replicas` 1)."""
    if args.draft and args.preset != "trained":
        raise SystemExit("beam-hpu demo: --draft needs --preset trained (the drafter is trained on that model)")
    model_dir = write_checkpoint(args.dir, args.preset, "bfloat16", 0, args.fp8)
    extra = draft_arguments(args.draft)
    cmd = serve_command(model_dir, port=args.port, tp=args.tp, ep=args.ep, extra=extra)
    base = f"http://127.0.0.1:{args.port}/v1"
    print(f"tiny Beam checkpoint: {model_dir}\nserving: {shlex.join(cmd)}\n"
          f"try, once it says 'Application startup complete':\n"
          f"  curl {base}/models\n"
          f"  curl {base}/chat/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{SERVED_NAME}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Repeat after me: Paris\"}}], "
          f"\"max_tokens\": 32}}'", flush=True)
    if args.print_only:
        return 0
    os.execvpe(cmd[0], cmd, serve_env(args.tp))
