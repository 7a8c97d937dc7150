#!/usr/bin/env bash
# Downloads, on a machine with PyPI, the wheels of the project's dependencies that an offline
# CUDA image (Python 3.12, x86-64, with jax, flax, optax, orbax, ml_dtypes, torch, transformers
# already installed) lacks, into .whl/ (git-ignored). benchmarks/gpu.sh installs them from there
# with --no-index --no-deps; carry .whl/ to that machine with the working tree.
#
#   benchmarks/fetch_wheels.sh                    # grain and tensorboardX, with their missing needs
#   PY_VERSION=3.11 benchmarks/fetch_wheels.sh    # for another Python
#   TUNIX=1 benchmarks/fetch_wheels.sh            # and Tunix 0.1.7 for `bench iteration`
#   benchmarks/fetch_wheels.sh NAME==X            # and more (each named: --no-deps fetches none)
#
# Tunix's `bench iteration` path (its Qwen3 model and loader, vanilla rollout, GRPO learner and
# trainer) imports, beyond the image's packages, only google-metrax, clu and perfetto: found by
# importing that path in a venv with `pip install google-tunix==0.1.7` and mapping the modules
# it loaded to their distributions; with these four wheels and --no-deps it races on CPU
# (tests/test_bench_iteration.py covers the race without Tunix).
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
if [[ -n "${TUNIX:-}" ]]; then
  WHEELS+=(google-tunix==0.1.7 google-metrax==0.2.4 clu==0.0.12 perfetto==0.59.1)
fi
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 any; do
  platforms+=(--platform "$p")
done
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
  --implementation cp "${platforms[@]}" -d "$DEST" "${WHEELS[@]}"
ls -l "$DEST"
