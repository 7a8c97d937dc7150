#!/usr/bin/env bash
# The sampler, learner-step and kernel benchmarks and the compiled kernel tests on one TPU chip
# (a GPU has its own script, benchmarks/gpu.sh), with native bf16, offline, in under 9 minutes
# (each step under its own `timeout`, so one hang does not eat the rest). Writes into DIR
# (default $OUT/bench where OUT is set, else runs/bench-tpu):
#
#   summary.json   the device (jax's device kind), jax's version and whether pyproject.toml
#                  admits it, the Pallas backend,
#                  and per step its exit status, seconds, command and last line of output
#   sampler.json   jaxrl-lp bench sampler  (small preset, dense and looped, against the HBM bound)
#   learner.json   jaxrl-lp bench learner  (GRPO step, dense and hybrid, tokens/s and MFU)
#   kernels_small.json, kernels_full.json
#                  jaxrl-lp bench kernels  (k=on: time, memory, HBM roofline fraction, MFU)
#   device.log     every step's stdout and stderr, in order
#
# The tests: tests/test_kernels_compiled.py (every kernel compiled, k=on, against its reference;
# replay == sampler with the kernels on) and tests/test_bench_kernels.py.
#
# Needs a python3 with JAX for the device, flax, optax, orbax-checkpoint, ml_dtypes and pytest.
# What it lacks (grain, tensorboardX and their needs) comes as wheels in .whl/, fetched beforehand
# on a machine with PyPI by benchmarks/fetch_wheels.sh and installed here with --no-index
# --no-deps into a private folder. The project itself is not installed: it runs from this
# checkout (PYTHONPATH), as `python3 -m jaxrl_lp.cli.main`, the `jaxrl-lp` command.
#
#   benchmarks/fetch_wheels.sh             # once, with PyPI
#   benchmarks/tpu.sh [DIR]                 # on the TPU VM, from the checkout
#   QUICK=1 ALLOW_CPU=1 benchmarks/tpu.sh   # the script's own check on a CPU
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PLATFORM=tpu
DIR="${1:-${OUT:+$OUT/bench}}"
DIR="${DIR:-runs/bench-$PLATFORM}"
PYTHON="${PYTHON:-python3}"
POLICY="${POLICY:-bf16}"
mkdir -p "$DIR"
LOG="$DIR/device.log"
STEPS="$DIR/.steps.tsv"
: > "$LOG"
: > "$STEPS"
t0=$(date +%s)

# Dependencies the image lacks, from wheels (never from a registry: the machine is offline).
SITE="${SITE:-/tmp/jaxrl_lp_site}"
if ! "$PYTHON" -c "import grain, tensorboardX" 2> /dev/null && compgen -G ".whl/*.whl" > /dev/null
then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl >> "$LOG" 2>&1 || { echo "$0: wheel install failed ($LOG)" >&2; exit 2; }
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# A TPU VM: jax itself says what it is.
DEVICE_NAME=$("$PYTHON" -c "
import jax
d = jax.devices()[0]
print(d.device_kind if d.platform == 'tpu' else '')" 2>/dev/null)
DEVICE_INFO="$DEVICE_NAME"
if [[ -z "$DEVICE_NAME" && -z "${ALLOW_CPU:-}" ]]; then
  echo "$0: no TPU answers (jax.devices()); ALLOW_CPU=1 to run anyway" >&2
  exit 2
fi
if ! "$PYTHON" -c "import jaxrl_lp.cli.main" >> "$LOG" 2>&1; then
  echo "$0: jaxrl_lp does not import (missing wheels? see $LOG and benchmarks/fetch_wheels.sh)" >&2
  exit 2
fi
JAXRL=("$PYTHON" -m jaxrl_lp.cli.main)

# The device's HBM bandwidth (GB/s) for the sampler's bound, by jax's device name.
HBM_GBPS=$("$PYTHON" -c "
from jaxrl_lp.bench.kernels import device_peaks
bw = device_peaks()['hbm_bytes_per_s']
print(round(bw / 1e9) if bw else 15)" 2>> "$LOG")
TUNIX=--no-tunix
"$PYTHON" -c "import tunix" > /dev/null 2>&1 && TUNIX=

# step NAME SECONDS COMMAND...: runs COMMAND under `timeout`, output to the log; records the
# step (exit status, seconds, its output's last line, the command).
step() {
  local name=$1 limit=$2 start rc out
  shift 2
  start=$(date +%s)
  out="$DIR/.$name.out"
  echo "=== $name (limit ${limit}s): $*" >> "$LOG"
  timeout -k 10 "$limit" "$@" > "$out" 2>&1
  rc=$?
  cat "$out" >> "$LOG"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" \
    "$(grep -v '^\s*$' "$out" | tail -n 1 | tr '\t' ' ')" "$*" >> "$STEPS"
  rm -f "$out"
  echo "$0: $name exit $rc after $(( $(date +%s) - start ))s" >&2
}

if [[ -n "${QUICK:-}" ]]; then  # the script's own check: tiny sizes, a few seconds each
  SIZE=tiny; SMALL=tiny; FULL=tiny; MIN_TIME=0; REPEATS=1
else
  SIZE=small; SMALL=small; FULL=full; MIN_TIME=1; REPEATS=3
fi

# Worst case, every limit reached: 485 s of steps, plus the set-up and the summary.
# The kernels compiled first: if they do not run here, nothing after them means much.
step kernel_tests 90 "$PYTHON" -m pytest -q -p no:cacheprovider -x tests/test_kernels_compiled.py
step sampler 90 "${JAXRL[@]}" bench sampler --sizes "$SIZE" --looped-sizes "$SIZE" \
  --looped-batches 1 --no-hf --policy "$POLICY" --repeats "$REPEATS" --min-time "$MIN_TIME" \
  --bandwidth-gbps "$HBM_GBPS" --out "$DIR/sampler.json"
step learner 80 "${JAXRL[@]}" bench learner --size "$SIZE" --policy "$POLICY" $TUNIX \
  --repeats "$REPEATS" --min-time "$MIN_TIME" --out "$DIR/learner.json"
# Kernels in two runs, so that the production shapes timing out leaves the small ones.
step kernels_small 60 "${JAXRL[@]}" bench kernels --shapes "$SMALL" --policy "$POLICY" \
  --repeats "$REPEATS" --min-time "$MIN_TIME" --out "$DIR/kernels_small.json"
step kernels_full 120 "${JAXRL[@]}" bench kernels --shapes "$FULL" --policy "$POLICY" \
  --repeats "$REPEATS" --min-time "$MIN_TIME" --out "$DIR/kernels_full.json"
# The kernel benchmark's own check: compiled kernels against their references (k=on).
step kernels_on_tests 45 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_bench_kernels.py

DEVICE_NAME="$DEVICE_NAME" DEVICE_INFO="$DEVICE_INFO" STEPS="$STEPS" LOG="$LOG" \
SECONDS_ALL=$(( $(date +%s) - t0 )) POLICY="$POLICY" HBM_GBPS="$HBM_GBPS" PLATFORM="$PLATFORM" \
"$PYTHON" - > "$DIR/summary.json" 2>> "$LOG" <<'PY'
import json, os, re
import jax
steps = {}
for line in open(os.environ["STEPS"]):
    name, rc, secs, last, cmd = line.rstrip("\n").split("\t", 4)
    steps[name] = {"exit": int(rc), "seconds": int(secs), "timed_out": rc in ("124", "137"),
                   "last_line": last[-300:], "command": cmd}
# The jax range pyproject.toml admits: what the lowering tests ran with.
bound = re.search(r'"jax>=([0-9.]+),<([0-9.]+)"', open("pyproject.toml").read())
num = lambda v: tuple(int(x) for x in re.findall(r"\d+", v)[:3])
admitted = bound is not None and num(bound[1]) <= num(jax.__version__) < num(bound[2])
print(json.dumps({
    "platform": os.environ["PLATFORM"],
    "device": os.environ["DEVICE_NAME"] or "none (no device answered)",
    "device_info": os.environ["DEVICE_INFO"], "jax": jax.__version__,
    "jax_admitted_by_pyproject": admitted,
    "pallas_backend": "mosaic_tpu",
    "jax_device": jax.devices()[0].device_kind, "policy": os.environ["POLICY"],
    "hbm_gbps_for_sampler_bound": float(os.environ["HBM_GBPS"]),
    "seconds": int(os.environ["SECONDS_ALL"]), "steps": steps}, indent=2))
PY
rm -f "$STEPS"
cat "$DIR/summary.json"
