#!/usr/bin/env bash
# The benchmarks and compiled kernel tests on one NVIDIA GPU: benchmarks/accelerator.sh.
PLATFORM=gpu exec "$(dirname "${BASH_SOURCE[0]}")/accelerator.sh" "$@"
