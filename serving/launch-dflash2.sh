#!/usr/bin/env bash
# The recipe's opt-in DFlash2 variant: serving/launch.sh plus Beam's own block drafter.
#
#   [DFLASH2_DRAFTER=DIR_OR_HUB_ID] serving/launch-dflash2.sh MODEL [more vllm serve args]
#
# What changes from launch.sh (recipe.yaml, `dflash2`): --no-async-scheduling (vllm-gaudi turns async
# scheduling off whenever speculation is on; the flag says so instead of leaving it silent),
# --speculative-config with method dflash, 7 drafted tokens a step (block 8, the drafter card's
# serving block) and DFLASH2_DRAFTER as the drafter (default the hub id
# reflection/Beam-1.0-501B-A23B-DFlash2; its config.json must be on this host, downloaded or a
# directory: the startup guard reads its architectures), and the bucket file:
# tp8-seqs16-256k-dflash2.txt, whose 7 decode seeds vllm-gaudi turns into 21 decode graphs at 7
# drafts, plus the 4 drafter block graphs the port's proposer (unit beam-dflash2-proposer) captures,
# one per padded batch: 25, the recipe's limit (`python -m serving.lint_buckets --dflash2`). The file
# is made for 7 drafts: the guard refuses method dflash at another count with it.
# Everything else, env and fixes included, is launch.sh's; grammar steps and sampled requests verify
# as in serving/launch-speculative.sh (beam-grammar-verify, beam-sampled-verify, and HTTP 400 for
# the fields hpu-speculative-sampling-limits names).
set -euo pipefail

if [ "$#" -lt 1 ]; then
  echo "usage: [DFLASH2_DRAFTER=DIR_OR_HUB_ID] $0 MODEL [vllm serve args...]" >&2
  exit 2
fi
MODEL=$1
shift
DRAFTER=${DFLASH2_DRAFTER:-reflection/Beam-1.0-501B-A23B-DFlash2}
case $DRAFTER in
  *'"'* | *'\'*)
    # It goes into a JSON string as is.
    echo "$0: DFLASH2_DRAFTER must not hold a double quote or a backslash: $DRAFTER" >&2
    exit 2
    ;;
esac

export VARIANT_BUCKETING_FROM_FILE=/opt/gaudi-cookbook/ports/beam-1-0/serving/tp8-seqs16-256k-dflash2.txt
exec "$(dirname "$0")/launch.sh" "$MODEL" --no-async-scheduling \
  --speculative-config "{\"method\": \"dflash\", \"model\": \"$DRAFTER\", \"num_speculative_tokens\": 7}" "$@"
