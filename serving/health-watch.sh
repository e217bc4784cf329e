#!/usr/bin/env bash
# Restart a replica that is alive but not answering: /health failing for UNHEALTHY_AFTER seconds.
#
#   serving/health-watch.sh URL UNIT [UNHEALTHY_AFTER] [INTERVAL]
#   e.g. http://127.0.0.1:8000/health beam-replica.service 120 10
#
# systemd's Restart= brings back a replica whose process exits (vLLM's API server exits a few
# seconds after its engine core dies; `rank-exception-fatal` makes a failed rank do exactly that).
# A hung one (a stuck collective) keeps running: this loop (serving/beam-replica-health.service)
# restarts UNIT then. Only while UNIT is active and ready: a loading replica (up to the recipe's
# 7200 s engine-ready timeout) is systemd's `activating`, and is left to wait-ready.sh.
set -u
URL=$1
UNIT=$2
UNHEALTHY_AFTER=${3:-120}
INTERVAL=${4:-10}
SYSTEMCTL=${SYSTEMCTL:-systemctl}
last_ok=$(date +%s)
while true; do
  now=$(date +%s)
  if [ "$($SYSTEMCTL is-active "$UNIT" 2>/dev/null)" != "active" ]; then
    last_ok=$now
  elif curl -fsS -o /dev/null --max-time 5 "$URL"; then
    last_ok=$now
  elif [ $(( now - last_ok )) -ge "$UNHEALTHY_AFTER" ]; then
    echo "$UNIT: $URL failing for $(( now - last_ok ))s (limit ${UNHEALTHY_AFTER}s): restarting"
    $SYSTEMCTL restart --no-block "$UNIT"
    last_ok=$now
  fi
  sleep "$INTERVAL"
done
