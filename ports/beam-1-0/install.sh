#!/usr/bin/env bash
# Build the beam-1-0 port into a stock vLLM 0.30.0 + vllm-gaudi releases/v0.30.0 install, in the
# recipe's order. The Dockerfile runs it with no arguments; it works the same outside Docker.
#
#   ports/beam-1-0/install.sh [options]
#     --profile NAME        fix profile (default v0.30.0)
#     --port-profile NAME   the port's runner patches, layered on it (default port-beam-1-0)
#     --root PKG=DIR        DIR holds PKG/ (vllm, vllm_gaudi); default: where Python finds PKG
#     --checkout PKG=DIR    read PKG's commit from this git checkout
#     --pip-target DIR      install the plugin into DIR (pip --target) instead of site-packages
#
# Environment: COOKBOOK (default: the repository holding this script), PYTHON (default python3).
#
# Steps (each stops the build with a non-zero exit and says why):
#   1. check the image commits      apply_all.py --profile P --check: refuses a tree the profile
#                                   was not written for (exit 3) or whose anchors moved (exit 1)
#   2. apply the fix profile        apply_all.py --profile P (all fixes or none)
#   3. parser files                 the beam reasoning/tool parsers ship inside the plugin
#                                   (beam_hpu/parsers, registered by register()): nothing is
#                                   copied into vLLM's tree
#   4. patch the runner             apply_all.py --profile PORT: exact sliding windows for Beam,
#                                   grammar bitmask on the device, bounded prompt attention
#                                   with cached context (the units in beam_hpu/runtime/<room>/)
#   5. install the plugin           pip install --no-deps of this repository (vLLM is never a
#                                   requirement: it is the image's own build)
#   6. build gates                  tests/build_gates.py: 8 gates, any failure fails the build
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
COOKBOOK=${COOKBOOK:-$(cd "$HERE/../.." && pwd)}
PYTHON=${PYTHON:-python3}
PROFILE=v0.30.0
PORT_PROFILE=port-beam-1-0
TREE_ARGS=()
PIP_TARGET=

while [ "$#" -gt 0 ]; do
  case "$1" in
    --profile) PROFILE=$2; shift 2 ;;
    --port-profile) PORT_PROFILE=$2; shift 2 ;;
    --root|--checkout) TREE_ARGS+=("$1" "$2"); shift 2 ;;
    --pip-target) PIP_TARGET=$2; shift 2 ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

step() { echo "== install.sh: $*"; }
fail() { echo "install.sh: FAILED: $*" >&2; exit 1; }

APPLY=("$PYTHON" "$COOKBOOK/fixes/apply_all.py")
[ -f "$COOKBOOK/fixes/apply_all.py" ] || fail "no fixes/apply_all.py under COOKBOOK=$COOKBOOK"

step "1/6 check the image commits (profile $PROFILE)"
set +e
"${APPLY[@]}" --profile "$PROFILE" --check ${TREE_ARGS[@]+"${TREE_ARGS[@]}"}
rc=$?
set -e
case $rc in
  0) echo "every fix already applied" ;;
  4) echo "the image is the one profile $PROFILE expects" ;;
  *) fail "profile $PROFILE refuses this image (apply_all.py --check exit $rc): see above" ;;
esac

step "2/6 apply the fix profile $PROFILE"
"${APPLY[@]}" --profile "$PROFILE" ${TREE_ARGS[@]+"${TREE_ARGS[@]}"} || fail "fix profile $PROFILE"

step "3/6 parser files: part of the plugin (beam_hpu/parsers), nothing to copy into vLLM"

step "4/6 patch the runner (profile $PORT_PROFILE)"
"${APPLY[@]}" --profile "$PORT_PROFILE" ${TREE_ARGS[@]+"${TREE_ARGS[@]}"} || fail "port patches $PORT_PROFILE"

step "5/6 install the beam_hpu plugin from $COOKBOOK"
PIP_ARGS=(install --no-deps --no-build-isolation --no-input --disable-pip-version-check)
if [ -n "$PIP_TARGET" ]; then
  PIP_ARGS+=(--target "$PIP_TARGET")
  export PYTHONPATH="$PIP_TARGET${PYTHONPATH:+:$PYTHONPATH}"
fi
# Build from a scratch copy so the checkout gets no build/ or *.egg-info.
BUILD_DIR=$(mktemp -d)
trap 'rm -rf "$BUILD_DIR"' EXIT
cp -R "$COOKBOOK/pyproject.toml" "$COOKBOOK/beam_hpu" "$BUILD_DIR/"
[ -f "$COOKBOOK/README.md" ] && cp "$COOKBOOK/README.md" "$BUILD_DIR/"
"$PYTHON" -m pip "${PIP_ARGS[@]}" "$BUILD_DIR" || fail "pip install of the plugin"

step "6/6 build gates"
cd /
COOKBOOK="$COOKBOOK" "$PYTHON" "$COOKBOOK/tests/build_gates.py" --profile "$PROFILE" --port-profile "$PORT_PROFILE" \
  --cookbook "$COOKBOOK" ${TREE_ARGS[@]+"${TREE_ARGS[@]}"} || fail "build gates"
echo "install.sh: the beam-1-0 port is installed"
