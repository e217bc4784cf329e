"""One Beam-1.0 expert (gate, up [2560, 5120], down [5120, 2560], FP8 with per-channel scales) to
transformers' fused (gate_up, down) as the streamed reference needs it: compressed-tensors'
dequantiser plus torch.cat (the path before) vs `beam_hpu.quant.fp8_dequant.dequantise_rows`.
Same bits (checked here too); rounds interleaved, the best of each printed, and their ratio.

  python benchmarks/fp8_dequant.py [--rounds 8] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from beam_hpu.quant.fp8_checkpoint import beam_fp8_quantization_config  # noqa: E402
from beam_hpu.quant.fp8_dequant import dequantise_rows  # noqa: E402

PROJ = {"gate_proj": (2560, 5120), "up_proj": (2560, 5120), "down_proj": (5120, 2560)}


def main() -> None:
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    p = "model.layers.3.mlp.experts.0"
    raw = {}
    for proj, shape in PROJ.items():
        raw[f"{p}.{proj}.weight"] = (torch.randn(shape, generator=g) * 16).clamp(-448, 448).to(torch.float8_e4m3fn)
        raw[f"{p}.{proj}.weight_scale"] = torch.rand((shape[0], 1), generator=g) * 0.01
    with tempfile.TemporaryDirectory() as d:
        qc = beam_fp8_quantization_config().model_dump(mode="json")
        qc["quant_method"] = "compressed-tensors"
        (Path(d) / "config.json").write_text(json.dumps({"model_type": "beam", "quantization_config": qc}))
        dequantizer = CompressedTensorsDequantizer(d, dtype=dtype)

    def before():
        w = dequantizer.process(dict(raw))
        return torch.cat([w[f"{p}.gate_proj.weight"], w[f"{p}.up_proj.weight"]]), w[f"{p}.down_proj.weight"]

    def after():
        w = {proj: (raw[f"{p}.{proj}.weight"], raw[f"{p}.{proj}.weight_scale"]) for proj in PROJ}
        return dequantise_rows([w["gate_proj"], w["up_proj"]], dtype), dequantise_rows([w["down_proj"]], dtype)

    a, b = before(), after()
    same = all(torch.equal(x, y) for x, y in zip(a, b))
    best = {"before": float("inf"), "after": float("inf")}
    for _ in range(args.rounds):
        for name, f in (("before", before), ("after", after)):
            t = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t)
    print(f"one expert to {args.dtype}, best of {args.rounds} interleaved rounds, {torch.get_num_threads()} threads: "
          f"compressed-tensors + cat {best['before']:.3f} s, dequantise_rows {best['after']:.3f} s: "
          f"**{best['before'] / best['after']:.2f}x**; same bits: {same}; per 256-expert layer "
          f"{256 * best['before']:.0f} s vs {256 * best['after']:.0f} s")


if __name__ == "__main__":
    main()
