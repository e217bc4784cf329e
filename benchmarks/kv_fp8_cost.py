"""What an FP8 KV cache costs the tiny trained Beam, with calibrated and with default scales.

    python benchmarks/kv_fp8_cost.py [FP8_CHECKPOINT]

Inputs (all printed): the FP8 checkpoint (default: the committed tiny trained Beam quantised as the
published checkpoint is, `quantize_checkpoint`), the CPU gate profile's passages with their scored
positions (`beam_hpu.gates.perplexity.cpu_passages`), scales calibrated on those same passages by
`beam_hpu.reference.kv_calibration.calibrate_kv` (streamed, fp32, activation range 448) and the
default scale 1.0 both servers use without scales. Each model is the per-token FP8 reference in fp32
(exact rounding) with K and V through `beam_hpu.quant.rounding.fp8_kv_round` at range 448 (vLLM-CPU)
and 240 (Gaudi 2 as vllm-gaudi rescales); the baseline is the same reference without KV rounding.
Figures over all scored positions of all passages: perplexity change, mean KL(baseline || FP8 KV)
over the vocabulary, top-1 agreement. Also per layer and tensor: K/V elements flushed to zero.
These are CPU numbers of a 2.7 MB model, not a measurement of Beam-501B on Gaudi.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from beam_hpu.quant.rounding import DEFAULT_KV_SCALE, FP8_E4M3FN_MAX, GAUDI2_FP8_MAX, fp8_kv_round
from beam_hpu.reference import kv_fp8
from beam_hpu.reference.in_memory import load_reference, next_token_logprobs
from beam_hpu.reference.kv_calibration import calibrate_kv
from beam_hpu.reference.kv_overlay import read_kv_scales
from beam_hpu.reference.plan import Passage
from fp8_perplexity_noise_floor import checkpoint_and_passages  # the same model and passages


def summary(base: dict, other: dict, passages: dict) -> str:
    nll_b = nll_o = kl = top = n = 0.0
    for name, (ids, scored) in passages.items():
        at = [i - 1 for i in range(1, len(ids)) if scored[i]]
        tok = torch.tensor([ids[i + 1] for i in at])[:, None]
        b, o = base[name][at], other[name][at]
        nll_b += float(-b.gather(1, tok).sum())
        nll_o += float(-o.gather(1, tok).sum())
        kl += float((b.exp() * (b - o)).sum(-1).sum())
        top += float((b.argmax(-1) == o.argmax(-1)).sum())
        n += len(at)
    return (f"perplexity {torch.exp(torch.tensor((nll_o - nll_b) / n)).item() - 1:+.4%}, KL {kl / n:.3e}, "
            f"top-1 {top / n:.4f} ({int(n)} scored positions)")


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        checkpoint, passages = checkpoint_and_passages(d)
        print(f"checkpoint {checkpoint}; passages (tokens, scored): "
              + ", ".join(f"{n} ({len(i)}, {sum(map(bool, s))})" for n, (i, s) in passages.items()))
        overlay = Path(d) / "overlay"
        calibrate_kv(checkpoint, [Passage(n, i, s) for n, (i, s) in passages.items()], overlay,
                     dtype=torch.float32, fp8_max=FP8_E4M3FN_MAX, exact=True)
        calibrated = read_kv_scales(overlay)
        default = kv_fp8.KvScales({i: (DEFAULT_KV_SCALE, DEFAULT_KV_SCALE) for i in calibrated.layers}, "default 1.0")
        print("calibrated (k_scale, v_scale) per layer: "
              + ", ".join(f"{i}: ({k:.4g}, {v:.4g})" for i, (k, v) in sorted(calibrated.layers.items())))
        for fp8_max in (FP8_E4M3FN_MAX, GAUDI2_FP8_MAX):
            model = load_reference(checkpoint, fp8_max=fp8_max, dtype=torch.float32, exact=True)
            seen = {}
            kv_fp8.set_kv_observer(model, lambda i, q, k, v: seen.setdefault(i, []).append((k, v)))
            base = {n: next_token_logprobs(model, ids) for n, (ids, _) in passages.items()}
            kv_fp8.set_kv_observer(model, None)
            print(f"\nKV cache range +-{fp8_max:g} ({'vLLM-CPU e4m3fn' if fp8_max == 448 else 'Gaudi 2'}), "
                  f"against the same reference without KV rounding:")
            for label, scales in (("calibrated", calibrated), ("default 1.0", default)):
                kv_fp8.set_kv_rounding(model, scales, fp8_max)
                other = {n: next_token_logprobs(model, ids) for n, (ids, _) in passages.items()}
                flushed = []
                for i, pairs in sorted(seen.items()):
                    for j, kind in ((0, "K"), (1, "V")):
                        x = torch.cat([p[j].flatten() for p in pairs])
                        r = fp8_kv_round(x, scales.layers[i][j], fp8_max)
                        flushed.append(f"{kind}{i} {float(((r == 0) & (x != 0)).double().mean()):.2%}")
                print(f"  {label:12s} {summary(base, other, passages)}; flushed to 0: {', '.join(flushed)}")


if __name__ == "__main__":
    main()
