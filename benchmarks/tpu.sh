#!/usr/bin/env bash
# The benchmarks and compiled kernel tests on one TPU chip: benchmarks/accelerator.sh.
PLATFORM=tpu exec "$(dirname "${BASH_SOURCE[0]}")/accelerator.sh" "$@"
