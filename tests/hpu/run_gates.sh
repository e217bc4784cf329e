#!/usr/bin/env bash
# The recipe's gates against a running Beam endpoint; prints the Markdown table, writes JSON.
#   tests/hpu/run_gates.sh --base-url http://HOST:PORT/v1 --model NAME [--only GATE] [--profile cpu|gaudi]
#                          [--json gates.json] [--reference-file ref.json | --reference-checkpoint DIR]
# Exit code 0 when every gate passed.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="${here}${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m beam_hpu.gates.run "$@"
