#!/usr/bin/env bash
# Wait until a replica's /health answers 200, or fail after TIMEOUT seconds.
#
#   serving/wait-ready.sh URL TIMEOUT [INTERVAL]     e.g. http://127.0.0.1:8000/health 7200 10
#
# The node's readiness check (serving/beam-replica.service runs it as ExecStartPost, so systemd
# calls the replica started only once it serves). TIMEOUT is the recipe's engine-ready timeout,
# VLLM_ENGINE_READY_TIMEOUT_S=7200: a node loads for 6 to 50 minutes (serving/multinode.md).
set -u
URL=$1
TIMEOUT=$2
INTERVAL=${3:-10}
start=$(date +%s)
while true; do
  if curl -fsS -o /dev/null --max-time 5 "$URL"; then
    echo "ready: $URL after $(( $(date +%s) - start ))s"
    exit 0
  fi
  if [ $(( $(date +%s) - start )) -ge "$TIMEOUT" ]; then
    echo "not ready: $URL after ${TIMEOUT}s" >&2
    exit 1
  fi
  sleep "$INTERVAL"
done
