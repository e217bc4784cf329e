#!/usr/bin/env bash
# The recipe's opt-in FP8 KV-cache variant: serving/launch.sh on a calibrated overlay, FP8 cache.
#
#   serving/launch-kv-fp8.sh OVERLAY [more vllm serve args]
#
# OVERLAY is the checkpoint with calibrated K/V scales (recipe.yaml `kv_fp8`, in order):
#   1. calibrate, once, where the 503 GB can be read (CPU is enough; streamed, resumable):
#        beam-hpu calibrate-kv CHECKPOINT --text PASSAGE.txt [--text ...] --out OVERLAY --fp8-max 240
#      OVERLAY holds config.json with kv_cache_scheme, the index, one small shard of k/v/q scales
#      and symlinks to the checkpoint's shards, which are never rewritten;
#   2. serve: this script (launch.sh's env, fixes and flags, plus --kv-cache-dtype fp8_inc);
#   3. gate: the reference that models the same cache, against this server:
#        beam-hpu reference CHECKPOINT --passages P.json --fp8-max 240 --kv-scales OVERLAY --out REF.json
#      (it prints what FP8 KV costs on those passages against the bf16-KV reference), then the
#      perplexity gate with --reference-file REF.json.
# A directory without calibrated scales is refused: vllm-gaudi would run the cache on default
# scales (amax 448), which nothing here has measured. Serve the overlay only through this script:
# a config with kv_cache_scheme makes vLLM pick an FP8 cache by itself where it can.
set -euo pipefail

if [ "$#" -lt 1 ]; then
  echo "usage: $0 OVERLAY [vllm serve args...]" >&2
  exit 2
fi
MODEL=$1
shift
if ! python3 - "$MODEL" <<'PY'
import json, sys
try:
    qc = json.load(open(f"{sys.argv[1]}/config.json")).get("quantization_config") or {}
except OSError as e:
    sys.exit(f"{e}")
sys.exit(0 if qc.get("kv_cache_scheme") else f"{sys.argv[1]}/config.json has no kv_cache_scheme: "
         "calibrate first (beam-hpu calibrate-kv CHECKPOINT ... --out OVERLAY)")
PY
then
  exit 2
fi

exec "$(dirname "$0")/launch.sh" "$MODEL" --kv-cache-dtype fp8_inc "$@"
