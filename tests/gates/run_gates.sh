#!/usr/bin/env bash
# The recipe's gates against a running Beam endpoint; prints the Markdown table, writes JSON.
#   tests/gates/run_gates.sh --base-url http://HOST:PORT/v1 --model NAME [--only GATE] [--profile cpu|gaudi]
#                          [--json gates.json] [--reference-file ref.json | --reference-checkpoint DIR]
#                          [--reference-dtype bfloat16|float32]   (default: the profile's; cpu: float32)
# Exit code 0 when every gate passed. --help also says how to make the 501B model's reference file.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="${here}${PYTHONPATH:+:$PYTHONPATH}"
for arg in "$@"; do
  if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then
    cat <<'EOF'
The perplexity gate on the node needs a stored reference file (--reference-file REF.json): the
per-token FP8 CPU reference's log-probabilities for the recipe's passages. Make it once per
checkpoint, on any x86-64 Linux host with the checkpoint on a local disk (no GPU or HPU):

  beam-hpu reference /models/Beam-1.0-501B-A23B --text p1.txt --text p2.txt --text p3.txt \
      --out beam-501b-ref.json --fp8-max 240      # 240: Gaudi 2's FP8 range (448: OCP e4m3)
  (or --passages FILE: JSON, name -> token ids or {"token_ids": [...], "scored": [...]})

It streams the checkpoint one layer at a time (the project's own reader; each tensor read once, an
MoE layer's experts in groups), so memory is one layer's working set plus the passages'
activations: peak RSS 4.0 GB (float32) measured on Beam-1.0-shaped layers at the recipe's three
passage lengths (benchmarks/reference_stream.py, README "Benchmarks"); a 16 GB host is plenty.
Time: one read of the 503 GB checkpoint plus the arithmetic, two forward passes per passage (the
reference, and the weight-only model its top-1 floor comes from) and the FP8 dequantisation of
every weight. On a small host the arithmetic dominates: on a 2-core AVX2 host (under load) an MoE
layer took 270-430 s for the 2,980 tokens of 257 + 1,024 + 1,699, of which its 10.2 GB read is
17-35 s; the 52 layers extrapolate to about 4.6 hours in --dtype float32. Time grows with the
passages' tokens and falls with cores: use the host with the most cores you have. Without native
bf16 matmuls (AVX2) float32 is several times faster than bfloat16 (the gate profile's reference
precision); with AVX512-BF16/AMX bfloat16 is the one to use.
Progress, per layer with an ETA, is logged on vllm.beam_hpu.reference.
Resume: if it is killed or stopped (--stop-after-layer K), run the same command again: it continues
after the newest layer saved in the workdir (--workdir, default REF.json.work: two layers' hidden
states, ~0.3 GB at 3K tokens); a truncated or corrupt layer file fails its checksum and is
recomputed. A workdir of another checkpoint, passages or options is refused, not overwritten.

EOF
    break
  fi
done
exec "${PYTHON:-python3}" -m beam_hpu.gates.run "$@"
