"""`beam-hpu reference` (layer streaming) on a Beam-1.0-shaped FP8 checkpoint: time, bytes, memory.

The checkpoint is the loader benchmark's (`benchmarks/loader_ep8.py`: Beam-1.0-501B-A23B's real
tensor shapes and compressed-tensors names, default 1 dense + 3 MoE layers) plus what a reference
also reads (embeddings, final norm, LM head) and a config.json with the FP8 quantization config.
Values are random but tame (FP8 weights from a random pool with per-channel scales that keep
activations O(1), a random router) so that tokens spread over all 256 experts as in the model.
The passages are the recipe's three lengths (257, 1024, 1699 tokens) of random ids by default.

Per layer, with the page cache emptied for the checkpoint before each cold measurement, in
--rounds interleaved rounds (the three back to back, their order rotated each round, so the host's
load falls on all three alike; benchmarks/measured_bounds.py):
  read   the raw sequential read of that layer's bytes (16 MiB reads, cold): the disk's limit;
  layer  `beam_hpu.reference.streamed.run_layer` as the command runs it (cold): seconds, bytes the reader
         asked for, bytes the kernel read from storage (/proc/self/io); every round's output equal;
  arith  the same layer's arithmetic on its own: the experts' bytes served from memory (a pool of
         real expert bytes, no disk), the rest from the page cache; routing is the real one.
Each printed as median [min-max over the rounds]; the layer's output is saved to the workdir once.
Then the final norm and LM head (once), and peak RSS (getrusage). Printed: the per-layer ratio
median(layer) / max(median(read), median(arith)) (target: at most 2), peak RSS (target: under
8 GB), and the extrapolation to Beam-1.0's 52 layers (3 dense + 49 MoE) for the same passages.
Read and arith are lower bounds of the layer that contains them: a ratio under 1 is printed as a
MEASUREMENT FAULT (not a result), the summary line says so and the exit status is 3.

Reduced runs (a shared or small host): fewer layers, shorter passages, `--experts N` (N a multiple
of Beam's 8 expert groups, at least 16: the routing keeps top-8 of 4 groups; not extrapolated),
`--threads 1`. The checkpoint goes to --dir (kept, reused) or else to a temporary directory that
is deleted at the end.

  python benchmarks/reference_stream.py [--dir DIR] [--dense-layers 1] [--moe-layers 3] [--experts 256]
      [--passage-tokens 257,1024,1699] [--dtype bfloat16|float32] [--rounds 3] [--threads N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from measured_bounds import Timing, rotated, verdict  # noqa: E402
from loader_ep8 import (  # noqa: E402  (shapes, names, cache and I/O accounting: one source)
    E, F32, FP8, H, MODEL_DENSE_LAYERS, MODEL_MOE_LAYERS, VOCAB, drop_cache, model_tensors,
    storage_read_bytes, write_sharded,
)

from beam_hpu.loader.reader import RangeReader  # noqa: E402
from beam_hpu.quant.fp8_checkpoint import beam_fp8_quantization_config  # noqa: E402
from beam_hpu.reference import plan as rp  # noqa: E402
from beam_hpu.reference import streamed as sr  # noqa: E402
from beam_hpu.reference.workdir import Workdir  # noqa: E402

POOL = 1 << 27  # FP8 values every weight is cut from (the largest weight has 105M)


def _value(name: str, shape, dt, pool: torch.Tensor, g: torch.Generator, fan_in: dict) -> torch.Tensor:
    n = torch.Size(shape).numel()
    if dt is FP8:
        start = int(torch.randint(0, POOL - n + 1, (1,), generator=g))
        return pool[start:start + n].reshape(shape).clone()
    if name.endswith("weight_scale"):  # FP8 values have std ~16; keep each output O(1)
        return torch.full(shape, 1.0 / (16 * math.sqrt(fan_in[name])), dtype=F32)
    if name.endswith("mlp.gate.weight"):
        return (torch.randn(shape, generator=g) * 0.02).to(dt)
    if name.endswith("gate_bias") or name.endswith("e_score_correction_bias"):
        return torch.zeros(shape, dtype=dt)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        scale = 1.0 if name.startswith("model.") else 0.02
        return torch.cat([(torch.randn((8192, shape[1]), generator=g) * scale).to(dt)
                          for _ in range(0, shape[0], 8192)])[: shape[0]]
    return torch.ones(shape, dtype=dt)  # norms


def write_checkpoint(directory: Path, dense: int, moe: int, experts: int = E) -> None:
    specs = model_tensors(dense, moe, embeddings=True, experts=experts)
    fan_in = {n + "_scale": s[1] for n, s, dt in specs if dt is FP8}
    g = torch.Generator().manual_seed(0)
    pool = (torch.randn(POOL, generator=g) * 16).clamp(-448, 448).to(FP8)
    write_sharded(directory, specs, lambda name, shape, dt: _value(name, shape, dt, pool, g, fan_in))
    qc = beam_fp8_quantization_config().model_dump(mode="json")
    qc["quant_method"] = "compressed-tensors"
    config = {"architectures": ["BeamForCausalLM"], "model_type": "beam", "num_hidden_layers": dense + moe,
              "mlp_layer_types": ["dense"] * dense + ["sparse"] * moe, "vocab_size": VOCAB, "hidden_size": H,
              "num_experts": experts, "torch_dtype": "bfloat16", "quantization_config": qc}
    (directory / "config.json").write_text(json.dumps(config, indent=1))


def raw_read(entries) -> tuple[float, int]:
    """Seconds to read the byte runs of `entries` in file order with 16 MiB reads (cold cache)."""
    runs = []
    for e in sorted(entries, key=lambda e: (e.file, e.offset)):
        if runs and runs[-1][0] == e.file and runs[-1][2] == e.offset:
            runs[-1][2] += e.nbytes
        else:
            runs.append([e.file, e.offset, e.offset + e.nbytes])
    drop_cache(sorted({e.file for e in entries}))
    buf = memoryview(bytearray(16 << 20))
    t0, total = time.perf_counter(), 0
    for file, start, end in runs:
        fd = os.open(file, os.O_RDONLY)
        try:
            off = start
            while off < end:
                n = os.preadv(fd, [buf[: min(len(buf), end - off)]], off)
                off, total = off + n, total + n
        finally:
            os.close(fd)
    return time.perf_counter() - t0, total


class MemoryExperts:
    """A reader for the arithmetic-only pass: each expert tensor served from memory, as the bytes of
    the same tensor of one of a few experts held there (the values differ, the work does not),
    everything else from `reader`."""

    def __init__(self, reader: RangeReader, served: dict):
        self.reader, self.served = reader, served  # (file, offset) -> uint8 tensor
        self.bytes_read = 0

    def read(self, requests) -> None:
        rest = []
        for r in requests:
            src = self.served.get((r.file, r.offset))
            if src is None:
                rest.append(r)
            else:
                torch.frombuffer(r.dest, dtype=torch.uint8).copy_(src[: len(r.dest)])
        self.reader.read(rest)


def served_from_memory(plan, reader: RangeReader, i: int, kept: int = 4) -> dict:
    held = {e: sr.ls.read_tensors(reader, plan.expert_entries(i, e)) for e in range(kept)}
    served = {}
    for e in range(plan.config.num_experts):
        src = held[e % kept]
        for x, y in zip(plan.expert_entries(i, e), plan.expert_entries(i, e % kept)):
            served[x.file, x.offset] = src[y.name].reshape(-1).view(torch.uint8)
    return served


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def warm(entries) -> None:
    """Leave `entries`' bytes in the page cache (the arithmetic-alone pass reads them from there)."""
    raw_read(entries)


def measure_layer(plan, i: int, states: dict, contexts, reader: RangeReader, rounds: int):
    """Layer `i`'s three timings, interleaved over `rounds` (order rotated per round): the raw read
    of its bytes (cold), the streamed layer (cold), its arithmetic alone. Returns the timings, the
    streamed layer's requested / storage-read bytes, the raw bytes and the layer's output states
    (every round's streamed output must be the same)."""
    ckpt, moe = plan.checkpoint, plan.is_moe(i)
    experts = [x for e in range(plan.config.num_experts) for x in plan.expert_entries(i, e)] if moe else []
    entries = plan.layer_entries(i) + experts
    served = served_from_memory(plan, reader, i) if moe else None
    seconds = {"read": [], "layer": [], "arith": []}
    got = {}

    def run(name):
        copy = {k: v.clone() for k, v in states.items()}
        if name == "read":
            s, got["raw_bytes"] = raw_read(entries)
            return s
        if name == "layer":
            drop_cache(ckpt.files)
            t, b0, s0 = time.perf_counter(), reader.bytes_read, storage_read_bytes()
            sr.run_layer(plan, i, copy, contexts, reader)
            s = time.perf_counter() - t
            got["requested"], got["storage"] = reader.bytes_read - b0, storage_read_bytes() - s0
            if "out" in got and any(not torch.equal(copy[k], got["out"][k]) for k in copy):
                sys.exit(f"layer {i}: the streamed layer's output differs between rounds; the rounds did not "
                         "repeat the same work")
            got["out"] = copy
            return s
        # arithmetic alone: the experts' bytes from memory, the rest of the layer from the page cache
        warm(plan.layer_entries(i) if moe else entries)
        t = time.perf_counter()
        sr.run_layer(plan, i, copy, contexts, MemoryExperts(reader, served) if moe else reader)
        return time.perf_counter() - t

    for r in range(rounds):
        for name in rotated(["read", "layer", "arith"], r):
            seconds[name].append(run(name))
    timings = {name: Timing(name, tuple(v)) for name, v in seconds.items()}
    return timings, got["requested"], got["storage"], got["raw_bytes"], got["out"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None,
                    help="the synthetic checkpoint's directory, reused when it holds this layer mix (default: "
                         "a new temporary directory, deleted at the end)")
    ap.add_argument("--dense-layers", type=int, default=1)
    ap.add_argument("--moe-layers", type=int, default=3)
    ap.add_argument("--experts", type=int, default=E,
                    help=f"experts per MoE layer (default Beam-1.0's {E}; fewer is a reduced run, not extrapolated)")
    ap.add_argument("--passage-tokens", default="257,1024,1699")
    ap.add_argument("--dtype", choices=sorted(sr.DTYPES), default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per layer (medians over them)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    with contextlib.ExitStack() as cleanup:
        if args.dir is None:
            args.dir = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="beam-reference-bench-")))
        return bench(args)


def bench(args) -> int:
    base_rss = rss_gb()
    directory = args.dir
    if not (directory / "config.json").exists():
        t = time.perf_counter()
        write_checkpoint(directory, args.dense_layers, args.moe_layers, args.experts)
        print(f"wrote synthetic checkpoint to {directory} in {time.perf_counter() - t:.0f} s")
    cfg = json.loads((directory / "config.json").read_text())
    if (cfg["mlp_layer_types"] != ["dense"] * args.dense_layers + ["sparse"] * args.moe_layers
            or cfg["num_experts"] != args.experts):
        sys.exit(f"{directory} holds another layer mix ({cfg['mlp_layer_types']}, {cfg['num_experts']} experts); "
                 "remove it or pass another --dir")
    lengths = [int(x) for x in args.passage_tokens.split(",")]
    g = torch.Generator().manual_seed(1)
    passages = [rp.Passage(f"random-{n}", torch.randint(0, VOCAB, (n,), generator=g).tolist()) for n in lengths]
    dtype = sr.DTYPES[args.dtype]
    t = time.perf_counter()
    plan = rp.make_plan(directory, passages, dtype)
    ckpt = plan.checkpoint
    reduced = "" if args.experts == E else f" REDUCED to {args.experts} experts per MoE layer (Beam-1.0: {E})"
    print(f"checkpoint: {len(ckpt.files)} shards, {ckpt.total_bytes / 1e9:.2f} GB ({args.dense_layers} dense + "
          f"{args.moe_layers} MoE layers of Beam-1.0 shapes, FP8{reduced}); passages {lengths} tokens; dtype "
          f"{args.dtype}; {torch.get_num_threads()} threads; {args.rounds} interleaved rounds per layer; checks "
          f"before work {time.perf_counter() - t:.1f} s")
    print(f"RSS after imports: {base_rss:.2f} GB")
    rows, faults = [], []
    with RangeReader(ckpt.files, 8, 16 << 20) as reader, tempfile.TemporaryDirectory(dir=directory.parent) as wd:
        work = Workdir(wd, plan.description)
        drop_cache(ckpt.files)
        t, b0 = time.perf_counter(), storage_read_bytes()
        states = sr._embed(plan, reader)
        print(f"embedding rows: {time.perf_counter() - t:.1f} s, storage read {(storage_read_bytes() - b0) / 1e6:.1f} MB")
        contexts = sr.Contexts(plan)
        for i in range(plan.config.num_hidden_layers):
            moe = plan.is_moe(i)
            timings, layer_b, storage_b, read_b, states = measure_layer(plan, i, states, contexts, reader, args.rounds)
            t = time.perf_counter()
            work.save(i, states)
            save_s = time.perf_counter() - t
            result = verdict(timings["layer"], [timings["read"], timings["arith"]])
            if result.fault:
                faults.append(i)
            read_s = timings["read"].median
            rows.append((moe, timings["layer"].median, save_s, read_s, read_b))
            print(f"layer {i} ({'MoE' if moe else 'dense'}): streamed {timings['layer'].text()}, requested "
                  f"{layer_b / 1e9:.2f} GB, storage read {storage_b / 1e9:.2f} GB | raw read of its "
                  f"{read_b / 1e9:.2f} GB {timings['read'].text()} ({read_b / read_s / 1e9:.2f} GB/s) | arithmetic "
                  f"alone {timings['arith'].text()} | layer / max(read, arith): {result.text(2)} | workdir save "
                  f"{save_s:.1f} s | peak RSS so far {rss_gb():.2f} GB", flush=True)
        head_entries = [ckpt.tensors["lm_head.weight"], ckpt.tensors["model.norm.weight"]]
        head_read_s, head_read_b = raw_read(head_entries)
        drop_cache(ckpt.files)
        t, b0 = time.perf_counter(), reader.bytes_read
        sr.head(plan, states, reader, 20)
        head_s, head_b = time.perf_counter() - t, reader.bytes_read - b0
        print(f"final norm + LM head (once): {head_s:.1f} s, requested {head_b / 1e9:.2f} GB (raw read "
              f"{head_read_s:.1f} s)")
    peak = rss_gb()
    print(f"peak RSS: {peak:.2f} GB (target < 8 GB; {base_rss:.2f} GB of it after imports)")
    if reduced:
        print(f"\nno extrapolation to Beam-1.0: this run is{reduced}")
    else:
        print("\n" + extrapolation(args, rows, head_s, peak, lengths))
    if faults:
        print(f"SUMMARY: MEASUREMENT FAULT in layer(s) {faults}: a bound measured above the layer it bounds; "
              "these ratios are not results (exit status 3)")
        return 3
    print("SUMMARY: every bound measured below the layer it bounds")
    return 0


def extrapolation(args, rows, head_s: float, peak: float, lengths: list[int]) -> str:
    mean = {kind: sum(r[1] + r[2] for r in rows if r[0] == kind) / max(1, sum(r[0] == kind for r in rows))
            for kind in (False, True)}
    full = model_tensors(MODEL_DENSE_LAYERS, MODEL_MOE_LAYERS, embeddings=True)
    full_bytes = sum(torch.Size(s).numel() * dt.itemsize for n, s, dt in full if n != "model.embed_tokens.weight")
    total_s = MODEL_DENSE_LAYERS * mean[False] + MODEL_MOE_LAYERS * mean[True] + head_s
    raw_gbs = sum(r[4] for r in rows) / sum(r[3] for r in rows) / 1e9
    return (f"extrapolation to Beam-1.0 ({MODEL_DENSE_LAYERS} dense + {MODEL_MOE_LAYERS} MoE layers), these passages "
            f"({sum(lengths)} tokens), {args.dtype}: {total_s / 60:.0f} min (dense {mean[False]:.0f} s, MoE "
            f"{mean[True]:.0f} s per layer, medians, incl. workdir save, head {head_s:.0f} s); reads "
            f"{full_bytes / 1e9:.0f} GB (embedding rows aside), which alone take "
            f"{full_bytes / 1e9 / raw_gbs / 60:.1f} min at this run's raw sequential {raw_gbs:.2f} GB/s; peak RSS "
            f"{peak:.2f} GB")


if __name__ == "__main__":
    sys.exit(main())
