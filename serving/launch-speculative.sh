#!/usr/bin/env bash
# The recipe's opt-in speculative variant: serving/launch.sh plus drafts.
#
#   [SPECULATIVE_CONFIG=JSON] serving/launch-speculative.sh MODEL [more vllm serve args]
#
# What changes from launch.sh (recipe.yaml, `speculative`): --no-async-scheduling (vllm-gaudi
# turns async scheduling off whenever speculation is on; the flag says so instead of leaving it
# silent), --speculative-config, by default prompt lookup (ngram, 4 drafts, lookup 2..4), and the
# bucket file: tp8-seqs16-256k-spec.txt, whose 8 decode seeds vllm-gaudi turns into 24 decode
# graphs at 4 drafts (the recipe's file would give 69; `python -m serving.lint_buckets --speculative`).
# Everything else, env and fixes included, is launch.sh's. The startup guards refuse what vllm-gaudi
# cannot serve with drafts (beam_hpu/settings/guards.py speculation_on_hpu): a method without a
# vllm-gaudi proposer, --async-scheduling, or synthetic acceptance. Grammar steps verify through the
# port patch beam-grammar-verify, sampled requests (temperature, top-k/top-p, seeds) through
# beam-sampled-verify; a request with penalties, bad words, allowed token ids, min_tokens or
# logprobs gets HTTP 400 naming the field (runtime patch hpu-speculative-sampling-limits).
set -euo pipefail

if [ "$#" -lt 1 ]; then
  echo "usage: $0 MODEL [vllm serve args...]" >&2
  exit 2
fi
MODEL=$1
shift
SPECULATIVE_CONFIG=${SPECULATIVE_CONFIG:-'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'}

export VARIANT_BUCKETING_FROM_FILE=/opt/gaudi-cookbook/ports/beam-1-0/serving/tp8-seqs16-256k-spec.txt
exec "$(dirname "$0")/launch.sh" "$MODEL" --no-async-scheduling --speculative-config "$SPECULATIVE_CONFIG" "$@"
