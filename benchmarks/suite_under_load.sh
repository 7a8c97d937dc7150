#!/usr/bin/env bash
# The default test suite (the README's test command) on a busy machine: HOGS processes
# spinning on the CPU beside it, and a cold XLA compilation cache, as a CI run on a shared
# 2-core machine meets it. Prints one JSON object; the log is in $LOG.
#
#   benchmarks/suite_under_load.sh            # 2 hogs
#   HOGS=0 benchmarks/suite_under_load.sh     # an idle machine, cold cache
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
HOGS="${HOGS:-2}"
PYTHON="${PYTHON:-python}"
LOG="${LOG:-$(mktemp /tmp/jaxrl_lp_suite.XXXX.log)}"
pids=()
for _ in $(seq 1 "$HOGS"); do
  "$PYTHON" -c "while True: pass" & pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
export JAX_COMPILATION_CACHE_DIR="$(mktemp -d /tmp/jaxrl_lp_cold_cache.XXXX)"
start=$(date +%s)
set +e
"$PYTHON" -m pytest -x -q -n 2 --dist worksteal -p no:cacheprovider > "$LOG" 2>&1
status=$?
set -e
seconds=$(( $(date +%s) - start ))
summary=$(tail -n 1 "$LOG")
printf '{"hogs": %s, "cores": %s, "seconds": %s, "exit": %s, "summary": "%s", "log": "%s"}\n' \
  "$HOGS" "$(nproc)" "$seconds" "$status" "$summary" "$LOG"
