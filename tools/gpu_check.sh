#!/usr/bin/env bash
# The GPU check: megarl's trainer and CUDA kernels on one bare GPU machine that has CUDA torch and nvcc and no vLLM
# (tools/gpu_check.py says what each part runs, bench/README.md#gpu-check what it measures), in under 10 minutes.
# Figures in OUT_DIR/figures.json, one line a part on stdout; exit 0 when every part passed, 1 when one failed or
# could not run, 3 without CUDA (after the setup, whose figures it writes).
#
#   tools/gpu_check.sh [OUT_DIR] [--parts kernels,collectives,tiny,big]   # default OUT_DIR runs/gpu_check
#   tools/gpu_check.sh --download [DIR] [PYVER]   # where pip reaches an index: the wheels the parts need that a bare
#                                                 # machine may lack, for CPython PYVER (3.12) into DIR (.whl), ~21 MiB
#   WHEELS=.whl tools/gpu_check.sh                # first installs from DIR what is missing of them (no index)
#   PYTHON=python3.12 STEPS=6 tools/gpu_check.sh  # the interpreter with CUDA torch (python3); steps of each model
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
NEEDED=(megatron-core==0.16.1 pyyaml safetensors pytest)  # what the parts import beyond torch (NEEDS in the .py)
WHEELS_OF_NEEDED=("${NEEDED[@]}" numpy packaging pluggy iniconfig pygments)  # and what those need

if [[ ${1:-} == --download ]]; then
  DIR=${2:-.whl}
  PLATFORMS=()
  for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
             manylinux2014_x86_64; do
    PLATFORMS+=(--platform "$tag")
  done
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "${3:-3.12}" --implementation cp \
    "${PLATFORMS[@]}" -d "$DIR" "${WHEELS_OF_NEEDED[@]}"
  du -sh "$DIR"
  exit 0
fi

OUT=${1:-runs/gpu_check}
if [[ -n ${WHEELS:-} ]]; then
  echo "gpu_check: installing what is missing of ${NEEDED[*]} from $WHEELS (no index)"
  "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" "${NEEDED[@]}" ||
    echo "gpu_check: the install from $WHEELS failed; each part that needs what is missing says so" >&2
fi
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PYTHON" tools/gpu_check.py "$OUT" --steps "${STEPS:-6}" "${@:2}"
