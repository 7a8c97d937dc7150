#!/usr/bin/env bash
# Downloads, on a machine with PyPI, the wheels of the project's dependencies that an offline
# CUDA image (Python 3.12, x86-64, with jax, flax, optax, orbax, ml_dtypes, torch, transformers
# already installed) lacks, into .whl/ (git-ignored). benchmarks/gpu.sh installs them from there
# with --no-index --no-deps; carry .whl/ to that machine with the working tree.
#
#   benchmarks/fetch_wheels.sh                    # grain and tensorboardX, with their missing needs
#   PY_VERSION=3.11 benchmarks/fetch_wheels.sh    # for another Python
#   benchmarks/fetch_wheels.sh google-tunix==X    # and more (each named: --no-deps fetches none)
#
# The versions are those of the development venv. Each wheel's own needs are listed by
# `unzip -p .whl/NAME-*.whl '*/METADATA' | grep ^Requires-Dist`; the image holds the rest
# (absl-py, cloudpickle, etils, numpy, protobuf, packaging, psutil).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
PY_VERSION="${PY_VERSION:-3.12}"
DEST="${DEST:-.whl}"
WHEELS=(grain==0.2.18 array_record==0.8.6 portpicker==1.6.0 tensorboardX==2.6.5 "$@")
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 any; do
  platforms+=(--platform "$p")
done
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
  --implementation cp "${platforms[@]}" -d "$DEST" "${WHEELS[@]}"
ls -l "$DEST"
