#!/usr/bin/env bash
# Serve Beam-1.0-501B-A23B-FP8 on one 8-card Gaudi 2 node as the recipe does, in the port image.
#
#   serving/launch.sh MODEL [more vllm serve args, e.g. --host 0.0.0.0 --port 8000 --served-model-name beam]
#
# MODEL is the checkpoint directory or hub id. COOKBOOK is where the image holds this repository
# (default /opt/gaudi-cookbook). The env block and flags are the recipe's, value for value:
# tests/serving/test_serving.py checks them against serving/recipe.yaml and the published recipe.
# The port refuses at startup what the recipe says not to do (beam_hpu/settings/guards.py check_startup).
set -euo pipefail

if [ "$#" -lt 1 ]; then
  echo "usage: $0 MODEL [vllm serve args...]" >&2
  exit 2
fi
MODEL=$1
shift
COOKBOOK=${COOKBOOK:-/opt/gaudi-cookbook}

export PT_HPU_LAZY_MODE=1
export PT_HPU_ENABLE_LAZY_COLLECTIVES=true
export VLLM_CONTIGUOUS_PA=false
export VLLM_SKIP_WARMUP=true
export VLLM_FP32_SOFTMAX=true
export VLLM_GRAPH_RESERVED_MEM=0.4
export VLLM_BUCKETING_FROM_FILE=/opt/gaudi-cookbook/ports/beam-1-0/serving/tp8-seqs16-256k.txt
export VLLM_ENGINE_READY_TIMEOUT_S=7200
export VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=3600
export VLLM_BEAM_ALWAYS_CONSTRAIN_OUTPUT=1
export VLLM_BEAM_STREAM_TOOL_ARGS=1
export BEAM_EXACT_ROUNDING=0
export BEAM_PREFILL_INFLIGHT=1
# Prompt attention tiles only where one FusedSDPA call would pass this bound: `beam-hpu card-check`'s
# BEAM_FSDPA_Q_TILE / BEAM_FSDPA_WS_GIB verdict says whether the tiles it makes are no slower.
export BEAM_FSDPA_WS_GIB=2
export BEAM_FSDPA_Q_TILE=256
export BEAM_GRAMMAR_DEVICE_MASK=1
# Gathered FP8 experts (port patch beam-moe-gather) stay off: 0 is vllm-gaudi's fused op, as in the
# Verified run. Its gain is a model (benchmarks/decode_model.py) whose premise, that the fused op
# streams every local expert however few are routed, no card has measured; if the op skips idle
# experts, gathering makes every single-stream step slower. serving/launch-moe-gather.sh turns it
# on once `beam-hpu card-check` on the node says "BEAM_MOE_GATHER: 1 pays".
export BEAM_MOE_GATHER=0
# Window-sized KV for the 43 sliding layers (port unit beam-window-kv-cache): off until a card run confirms it.
export BEAM_WINDOW_KV=0
# serving/launch-speculative.sh and launch-dflash2.sh serve with their own bucket files
# (recipe.yaml speculative.env, dflash2.env).
if [ -n "${VARIANT_BUCKETING_FROM_FILE:-}" ]; then VLLM_BUCKETING_FROM_FILE=$VARIANT_BUCKETING_FROM_FILE; fi
# serving/launch-moe-gather.sh: the opt-in gathered experts (recipe.yaml moe_gather.env).
if [ -n "${VARIANT_MOE_GATHER:-}" ]; then BEAM_MOE_GATHER=$VARIANT_MOE_GATHER; fi

# Fixes: the v0.30.0 profile, in the pack's order.
# Stops with a non-zero exit code if the image does not match.
python3 "$COOKBOOK/fixes/apply_all.py" --profile v0.30.0 || exit 1

exec vllm serve "$MODEL" \
  --tensor-parallel-size 8 \
  --enable-expert-parallel \
  --load-format beam \
  --dtype bfloat16 \
  --block-size 128 \
  --max-model-len 262144 \
  --max-num-seqs 16 \
  --max-num-batched-tokens 4096 \
  --gpu-memory-utilization 0.90 \
  --max-cudagraph-capture-size 4 \
  --enable-prefix-caching \
  --enable-prompt-tokens-details \
  --async-scheduling \
  --reasoning-parser beam \
  --enable-auto-tool-choice \
  --tool-call-parser beam \
  "$@"
