#!/usr/bin/env bash
# The recipe's opt-in gathered-experts variant: serving/launch.sh with BEAM_MOE_GATHER=1 (recipe.yaml
# `moe_gather`): batch-1 decode steps compute only the experts they route to (port patch
# beam-moe-gather) instead of vllm-gaudi's fused op over every local expert.
#
#   serving/launch-moe-gather.sh MODEL [more vllm serve args]
#
# Off in the recipe: its gain is a model (benchmarks/decode_model.py), not a card measurement. Run it
# on a card beside serving/launch.sh (single-stream tok/s, then the gates) before serving with it.
set -euo pipefail

if [ "$#" -lt 1 ]; then
  echo "usage: $0 MODEL [vllm serve args...]" >&2
  exit 2
fi
export VARIANT_MOE_GATHER=1
exec "$(dirname "$0")/launch.sh" "$@"
