#!/usr/bin/env bash
# The GPU tier and the GPU benchmarks on one NVIDIA GPU, offline, in at most 8 minutes (each step
# under its own `timeout`, the slowest last). Writes into DIR (default docs/bench), named by the
# device (e.g. `h200` for an NVIDIA H200):
#
#   gpu-<device>.json      the device, jax, and per step its exit status, seconds, command and
#                          last line of output (the tier's pytest summary among them)
#   replay-<device>.json   jaxrl-lp bench replay: replay == sampler at Qwen3-0.6B and Ouro-1.4B
#                          shapes, bf16 and fp32, whole batch, 2- and 4-way slices, shuffled rows,
#                          max_staleness 1; the first cell with --cost and --traced
#   train-<device>.json    the default `jaxrl-lp train`'s summary.json, with its GRPO steps'
#                          replay_verified count and largest mismatch
#   gpu-<device>.log       every step's output, in order
#
# Steps: the tier's quick cells (`pytest -m gpu -k "not model_sizes"`: the compiled-kernel
# cells, the tiny exactness cells of every path, a run in minibatches, the start probe) beside
# the default `jaxrl-lp train` (nothing is timed there), then `bench replay` alone (its first
# cell times the sampler). The model-size cells of the tier are `bench replay`'s. The dry run
# on a CPU (ALLOW_CPU=1, no GPU) collects the tier's tests without running them.
#
# SUITE=speed runs the speed cells instead (each alone on the GPU, under 8 minutes together),
# writing gpu-speed-<device>.json (the steps, as above) and gpu-speed-<device>.log beside:
#   sampler-<device>.json  jaxrl-lp bench sampler: Qwen3-0.6B bf16, 128 + 256 tokens, B 32 and
#                          256: tokens/s and the fraction of the HBM bound (weights as the loop
#                          reads them + the KV cache); Ouro-1.4B bf16 at B 32, dense against
#                          deferred looped decoding, and the ideal speed-up
#   learner-<device>.json  jaxrl-lp bench learner: the GRPO update at Qwen3-0.6B bf16, 32 x 384
#                          tokens, dense and on the recorded log-probs (hybrid-recorded): MFU
#                          against the device's dense bf16 peak
#
# SUITE=iteration races whole GRPO iterations, ours against Tunix's on the same checkpoint
# (Tunix from .whl/: `TUNIX=1 benchmarks/fetch_wheels.sh`; without it ours alone), writing
# gpu-iteration-<device>.json and .log beside:
#   iteration-<device>.json  jaxrl-lp bench iteration: Qwen3-0.6B bf16, 32 rows (8 prompts x
#                          G 4), 128 + 256 tokens, minibatches 1 and 4, ours hybrid, traced
#                          (the replay's mechanism off: what it costs) and dense, the per-phase
#                          split and the device's roofline measured in the run
#
# SUITE=profile says where the time goes (jax.profiler, per XLA op, named by its HLO op_name),
# writing gpu-profile-<device>.json and .log beside:
#   profile-sampler-<device>.json  benchmarks/profile_sampler.py: the rollout at Qwen3-0.6B bf16,
#                          32 rows (8 prompts x 4), 128 + 256 tokens: the top ops, the weight
#                          matmuls' share, the trace lines read
#   profile-update-<device>.json   benchmarks/profile_update.py: the GRPO update at Qwen3-0.6B
#                          bf16, 32 x 384 tokens (hybrid on the recorded log-probs), its top ops
#
# SUITE=graphs races the decode loop without and with XLA's GPU flags (`jaxrl_lp.xla_flags`: CUDA
# graphs around the decode `while` loop), each in its own process (XLA reads XLA_FLAGS once),
# alternating, writing gpu-graphs-<device>.json and .log beside:
#   sampler-flags-<preset>-<device>.json  jaxrl-lp bench sampler --xla-gpu-flags <preset>: Qwen3-0.6B
#                          bf16, 128 + 256 tokens, B 32 and 256, tokens/s and fraction of the bound
#   decode-flags-<device>.json  the A/B: tokens/s and fraction of the bound per batch and preset,
#                          each preset's speed-up over `none`
#   replay-flags-<preset>-<device>.json  jaxrl-lp bench replay under the last preset's flags:
#                          replay == sampler at Qwen3-0.6B bf16
#
# SUITE=invariant asks whether a decode's product gives a row the learner's bits on the GPU
# (issue 51's GPU half; under a minute), writing gpu-invariant-<device>.json and .log beside:
#   fixed-tile-<device>.json  benchmarks/fixed_tile.py: Qwen3-0.6B's projection widths, bf16,
#                          B 32, T 384: the decode's rows whose bits differ from the learner's,
#                          XLA's product against the fixed-tile Mosaic GPU kernel
#                          (kernels.fixed_tile), the kernel against the f32 product, and the
#                          time of each at 32 and at 12,288 rows
#   fixed-tile-model-<device>.json  the same script --model qwen3-0.6b (random weights, bf16,
#                          32 rows of 64 + 64 tokens): the sampler with every product in fixed
#                          tiles against the learner's invariant forward (tokens whose bits
#                          differ, whole and in halves), beside the plain sampler against the
#                          dense forward, and the times of each
#
# SUITE=kernels compiles our retired GPU kernels on the GPU (`kernels.dispatch.RETIRED`; inside
# `unretired`) and races each against XLA's path (issue 52's kernel table; under 7 minutes),
# writing gpu-kernels-<device>.json and .log beside:
#   kernels-retired-fp32-<device>.json  jaxrl-lp bench kernels --kernels retired --policy fp32,
#                          the `small` shapes: each kernel's result against its reference, the
#                          kernel tests' tolerances (correctness first)
#   kernels-retired-logprob-<device>.json  the log-prob in bf16 (`s=native`) at the `small` and
#                          `full` shapes (Qwen3-0.6B's read-out, 4096 x 1024 x 151,936), forward
#                          and backward and forward alone: time and memory of the Triton kernel,
#                          the reference, the plain path, XLA's tiled read-out (what a GPU program
#                          runs) and the tiled read-out with the Mosaic GPU forward (the port,
#                          kernels.logprob_mgpu); MFU of each
#   kernels-retired-memory-<device>.json  the quantizers and decode attention, the same way:
#                          time, memory and the fraction of the HBM bound
#
# SUITE=fp8 races the per-tensor FP8 policy, whose products are FP8 GEMMs on a GPU and whose
# decode reads FP8 codes (kernels.fake_quant.FP8_GEMM_FORMATS), against bf16 in the same call
# (issue 52's "FP8 policies as real FP8 GEMMs on Hopper, measured against bf16"; under 10
# minutes), writing gpu-fp8-<device>.json and .log beside:
#   sampler-fp8-<device>.json, sampler-bf16-<device>.json  jaxrl-lp bench sampler at Qwen3-0.6B,
#                          B 32 and 256, 128 + 256 tokens: tokens/s and the fraction of the HBM
#                          bound (the fp8 loop reads 1 byte a weight)
#   learner-fp8-<device>.json, learner-fp8-fresh-<device>.json, learner-bf16-<device>.json
#                          jaxrl-lp bench learner, the dense GRPO update at Qwen3-0.6B, 32 x 384
#                          tokens: time and MFU (fp8: the forward's products FP8 GEMMs, the
#                          `reuse` backward's f32; fp8,bwd=fresh: all three FP8 GEMMs)
#
# Needs a python3 with JAX for the GPU, flax, optax, orbax-checkpoint, ml_dtypes and pytest. What
# it lacks (grain, tensorboardX and their needs) comes as wheels in .whl/, fetched beforehand on
# a machine with PyPI by benchmarks/fetch_wheels.sh and installed with --no-index --no-deps into a
# private folder. The project runs from this checkout (PYTHONPATH), not installed.
#
#   benchmarks/fetch_wheels.sh                 # once, with PyPI
#   benchmarks/gpu.sh [DIR]                    # on the GPU machine, from the checkout
#   PRESETS=qwen3-0.6b SKIP_TRAIN=1 benchmarks/gpu.sh   # a part of it
#   SUITE=speed benchmarks/gpu.sh                        # the speed cells
#   SUITE=iteration benchmarks/gpu.sh                    # the iteration against Tunix
#   SUITE=profile benchmarks/gpu.sh                      # where a rollout's and an update's time goes
#   SUITE=graphs benchmarks/gpu.sh                       # decode without and with the GPU flags
#   SUITE=invariant benchmarks/gpu.sh                    # a decode's product against the learner's
#   SUITE=kernels benchmarks/gpu.sh                      # the retired kernels against XLA's path
#   SUITE=fp8 benchmarks/gpu.sh                          # the fp8 policy against bf16
#   QUICK=1 ALLOW_CPU=1 benchmarks/gpu.sh /tmp/x        # the script's own check on a CPU
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DIR="${1:-docs/bench}"
PYTHON="${PYTHON:-python3}"
PRESETS="${PRESETS:-qwen3-0.6b,ouro-1.4b}"
mkdir -p "$DIR"
SITE="${SITE:-/tmp/jaxrl_lp_site}"
if ! "$PYTHON" -c "import grain, tensorboardX" 2> /dev/null && compgen -G ".whl/*.whl" > /dev/null
then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl > /dev/null 2>&1 || { echo "$0: wheel install failed" >&2; exit 2; }
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # two processes share the GPU
NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
if [[ -z "$NAME" && -z "${ALLOW_CPU:-}" ]]; then
  echo "$0: no GPU answers nvidia-smi; ALLOW_CPU=1 to run anyway" >&2
  exit 2
fi
# The device's short name: the last word of nvidia-smi's, lower case (`NVIDIA H200` -> h200).
DEV=$(echo "${NAME:-cpu}" | awk '{print tolower($NF)}' | tr -c 'a-z0-9\n' '-')
[[ -n "${ALLOW_CPU:-}" && -z "$NAME" ]] && DEV=cpu-dry-run
SUITE="${SUITE:-exactness}"
case "$SUITE" in
  exactness) TAG=gpu ;;
  speed) TAG=gpu-speed ;;
  iteration) TAG=gpu-iteration ;;
  profile) TAG=gpu-profile ;;
  graphs) TAG=gpu-graphs ;;
  invariant) TAG=gpu-invariant ;;
  kernels) TAG=gpu-kernels ;;
  fp8) TAG=gpu-fp8 ;;
  *) echo "$0: SUITE must be exactness, speed, iteration, profile, graphs, invariant, kernels or fp8, got '$SUITE'" >&2
     exit 2 ;;
esac
LOG="$DIR/$TAG-$DEV.log"
STEPS="$DIR/.steps-$TAG-$DEV.tsv"
: > "$LOG"; : > "$STEPS"
if ! "$PYTHON" -c "import jaxrl_lp.cli.main" >> "$LOG" 2>&1; then
  echo "$0: jaxrl_lp does not import (missing wheels? see $LOG, benchmarks/fetch_wheels.sh)" >&2
  exit 2
fi
JAXRL=("$PYTHON" -m jaxrl_lp.cli.main)
t0=$(date +%s)

# step NAME SECONDS COMMAND...: COMMAND under `timeout`, its output appended to the log when it
# ends; records (exit status, seconds, last line of output, command).
step() {
  local name=$1 limit=$2 start rc out
  shift 2
  start=$(date +%s)
  out="$DIR/.$name-$DEV.out"
  timeout -k 10 "$limit" "$@" > "$out" 2>&1
  rc=$?
  { echo "=== $name (limit ${limit}s, exit $rc): $*"; cat "$out"; } >> "$LOG"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" \
    "$(grep -v '^\s*$' "$out" | tail -n 1 | tr '\t' ' ')" "$*" >> "$STEPS"
  rm -f "$out"
  echo "$0: $name exit $rc after $(( $(date +%s) - start ))s" >&2
}

if [[ -n "${QUICK:-}" ]]; then  # tiny sizes, a few seconds a step
  export QUICK
  PRESETS=tiny-qwen3,tiny-ouro
  REPLAY=(--prompts 4 --prompt-len 12 --new-tokens 16)
  TRAIN=(--set sft.steps=20 --set grpo.steps=3)
  SAMPLER=(--sizes tiny-qwen3 --batch 2,4 --looped-sizes tiny-ouro --looped-batches 2
           --prompt-len 8 --new-tokens 8)
  LEARNER=(--size tiny-qwen3 --batch 4 --seq-len 24 --prompt-len 8)
  ITERATION=(--size tiny-qwen3 --batch 4 --group 2 --prompt-len 4 --new-tokens 4)
  PROFILE_SAMPLER=(--size tiny-qwen3 --prompts 2 --prompt-len 8 --new-tokens 8)
  PROFILE_UPDATE=(--size tiny-qwen3 --batch 4 --prompt-len 8 --seq-len 24)
  GRAPHS=(--sizes tiny-qwen3 --batch 2,4 --prompt-len 8 --new-tokens 8)
  FIXED_TILE=(--batch 4 --tokens 8 --widths 128x128 --repeats 2)
  FIXED_TILE_MODEL=(--model tiny-qwen3 --prompts 2 --group 2 --prompt-len 8 --new-tokens 8)
  KERNELS=(--shapes tiny --repeats 1 --min-time 0)
  KERNELS_FP32=("${KERNELS[@]}" --cases logprob,quantize_nvfp4,decode)
  KERNELS_MEMORY=quantize_nvfp4,decode
else
  REPLAY=()
  TRAIN=()
  SAMPLER=(--sizes qwen3-0.6b --batch 32,256 --looped-sizes ouro-1.4b --looped-batches 32
           --prompt-len 128 --new-tokens 256)
  LEARNER=(--size qwen3-0.6b --batch 32 --seq-len 384 --prompt-len 128)
  ITERATION=(--size qwen3-0.6b --batch 32 --group 4 --prompt-len 128 --new-tokens 256)
  PROFILE_SAMPLER=(--size qwen3-0.6b --prompts 8 --prompt-len 128 --new-tokens 256)
  PROFILE_UPDATE=(--size qwen3-0.6b --batch 32 --prompt-len 128 --seq-len 384)
  GRAPHS=(--sizes qwen3-0.6b --batch 32,256 --prompt-len 128 --new-tokens 256)
  FIXED_TILE=()
  FIXED_TILE_MODEL=(--model qwen3-0.6b --prompts 8 --group 4 --prompt-len 64 --new-tokens 64)
  KERNELS=(--shapes small,full --repeats 2 --min-time 0)
  KERNELS_FP32=(--shapes small --repeats 1 --min-time 0 --inner 1)
fi
# The retired GPU kernels compile on a GPU only; the dry run interprets them.
RETIRED=(--kernels retired)
[[ "$DEV" == cpu-dry-run ]] && RETIRED=(--kernels interpret)
# Off a GPU (the dry run) the tier's tests run in CI's own tiers (tests/test_gpu.py in the
# slow tier, tests/test_kernels_compiled.py in the default suite): collected here, not run.
TIER=()
[[ "$DEV" == cpu-dry-run ]] && TIER=(--collect-only)
# The presets SUITE=graphs races (jaxrl_lp.xla_flags.PRESETS), `none` first.
FLAG_SETS="${FLAG_SETS:-none,decode_graphs}"

if [[ "$SUITE" == speed ]]; then
  # Worst case 260 + 200 s of steps, one at a time (the timings want the GPU alone).
  step sampler 260 "${JAXRL[@]}" bench sampler "${SAMPLER[@]}" --policy bf16 --no-hf \
    --repeats 2 --min-time 0 --out "$DIR/sampler-$DEV.json"
  step learner 200 "${JAXRL[@]}" bench learner "${LEARNER[@]}" --policy bf16 --no-tunix \
    --methods dense,hybrid-recorded --repeats 2 --min-time 0 --out "$DIR/learner-$DEV.json"
fi

if [[ "$SUITE" == iteration ]]; then
  # One step, alone on the GPU: ours and Tunix's alternate after two warm-ups each.
  step iteration 420 "${JAXRL[@]}" bench iteration "${ITERATION[@]}" --looped-size "" \
    --policy bf16 --minibatches 1,4 --methods hybrid,traced,dense --repeats 2 \
    --out "$DIR/iteration-$DEV.json"
fi

if [[ "$SUITE" == profile ]]; then
  # One at a time, alone on the GPU: two warm-up calls, then one call under the profiler.
  step profile_sampler 200 "$PYTHON" benchmarks/profile_sampler.py "${PROFILE_SAMPLER[@]}" \
    --policy bf16 --repeats 2 --calls 1 --top 40 --out "$DIR/profile-sampler-$DEV.json"
  step profile_update 200 "$PYTHON" benchmarks/profile_update.py "${PROFILE_UPDATE[@]}" \
    --policy bf16 --full --steps 1 --top 40 --out "$DIR/profile-update-$DEV.json"
fi

if [[ "$SUITE" == graphs ]]; then
  # Each preset in its own process, one at a time (worst case 2 x 170 + 120 s); each times its
  # cells at least twice after a warm-up (`--repeats 2`, the fastest kept). Then the replay
  # under the last preset: the flags change launches, not arithmetic, so it must still be the
  # sampler's bits (Qwen3-0.6B bf16, whole batch and slices).
  for flags in ${FLAG_SETS//,/ }; do
    step "sampler_$flags" 170 "${JAXRL[@]}" bench sampler "${GRAPHS[@]}" \
      --looped-sizes "" --policy bf16 --no-hf --repeats 2 --min-time 0 \
      --xla-gpu-flags "$flags" --out "$DIR/sampler-flags-$flags-$DEV.json"
  done
  flags=${FLAG_SETS##*,}
  XLA=$("$PYTHON" -c "from jaxrl_lp.xla_flags import flags_for, parse
print(' '.join(flags_for(parse('$flags'))))")
  step "replay_$flags" 120 env XLA_FLAGS="${XLA_FLAGS:-} $XLA" "${JAXRL[@]}" bench replay \
    --presets "${PRESETS%%,*}" --policies bf16 "${REPLAY[@]}" \
    --out "$DIR/replay-flags-$flags-$DEV.json"
  FLAG_SETS="$FLAG_SETS" DIR="$DIR" DEV="$DEV" "$PYTHON" - >> "$LOG" 2>&1 <<'PY'
import json, os, pathlib
d = pathlib.Path(os.environ["DIR"]); dev = os.environ["DEV"]
sets = os.environ["FLAG_SETS"].split(",")
cells = {}
for name in sets:
    f = d / f"sampler-flags-{name}-{dev}.json"
    if not f.is_file():
        continue
    j = json.loads(f.read_text())
    for cell, tps in j["ours_tokens_per_s"].items():
        cells.setdefault(cell, {})[name] = {
            "tokens_per_s": tps, "fraction_of_bound": j["ours_fraction_of_bound"][cell],
            "xla_flags": j["xla_gpu_flags"]["flags"]}
for cell, by in cells.items():
    for name in by:
        if "none" in by and name != "none":
            by[name]["speedup_vs_none"] = round(by[name]["tokens_per_s"]
                                                / by["none"]["tokens_per_s"], 4)
replay = d / f"replay-flags-{sets[-1]}-{dev}.json"
exact = json.loads(replay.read_text()).get("replay_equals_sampler") if replay.is_file() else None
(d / f"decode-flags-{dev}.json").write_text(json.dumps(
    {"target": "decode-flags", "device": dev, "presets": sets, "cells": cells,
     "replay_equals_sampler": {sets[-1]: exact}}, indent=2) + "\n")
PY
fi

if [[ "$SUITE" == invariant ]]; then
  # Alone on the GPU (it times products): four widths, each compiled twice a row count.
  step fixed_tile 240 "$PYTHON" benchmarks/fixed_tile.py "${FIXED_TILE[@]}" \
    --out "$DIR/fixed-tile-$DEV.json"
  # Then the whole model: the sampler in fixed tiles against the learner's forward.
  step fixed_tile_model 300 "$PYTHON" benchmarks/fixed_tile.py --widths "" \
    "${FIXED_TILE_MODEL[@]}" --out "$DIR/fixed-tile-model-$DEV.json"
fi

if [[ "$SUITE" == kernels ]]; then
  # One at a time, alone on the GPU: correctness in f32 first, then the times in bf16.
  step kernels_fp32 120 "${JAXRL[@]}" bench kernels "${RETIRED[@]}" --policy fp32 \
    "${KERNELS_FP32[@]}" --out "$DIR/kernels-retired-fp32-$DEV.json"
  # bf16 stored and carried (`s=native`, as a GPU run's policy): the Mosaic read-out's operands.
  step kernels_logprob 240 "${JAXRL[@]}" bench kernels "${RETIRED[@]}" --policy bf16,s=native \
    "${KERNELS[@]}" --cases logprob --out "$DIR/kernels-retired-logprob-$DEV.json"
  step kernels_memory 180 "${JAXRL[@]}" bench kernels "${RETIRED[@]}" --policy bf16,s=native \
    "${KERNELS[@]}" --cases "${KERNELS_MEMORY:-quantize,dequantize,decode}" \
    --out "$DIR/kernels-retired-memory-$DEV.json"
fi

if [[ "$SUITE" == fp8 ]]; then
  # One at a time, alone on the GPU: each policy's sampler, then each policy's update.
  for POLICY in fp8 bf16; do
    step "sampler_$POLICY" 140 "${JAXRL[@]}" bench sampler "${SAMPLER[@]}" --looped-sizes "" \
      --policy "$POLICY" --no-hf --repeats 2 --min-time 0 --out "$DIR/sampler-$POLICY-$DEV.json"
  done
  # The update under each backward rule (`fresh`: all three products FP8 GEMMs), then bf16.
  for NAME in fp8 fp8-fresh bf16; do
    POLICY=${NAME/-fresh/,bwd=fresh}
    step "learner_$NAME" 100 "${JAXRL[@]}" bench learner "${LEARNER[@]}" --policy "$POLICY" \
      --no-tunix --methods dense --repeats 2 --min-time 0 --out "$DIR/learner-$NAME-$DEV.json"
  done
fi

if [[ "$SUITE" == exactness ]]; then
# Worst case, every limit reached: max(150, 200) + 260 s of steps, plus the set-up (under 8
# minutes). `bench replay` prints each cell as it ends (in the log), fp32's last.
step tier 150 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -k "not model_sizes" \
  "${TIER[@]}" tests/test_gpu.py tests/test_kernels_compiled.py &
if [[ -z "${SKIP_TRAIN:-}" ]]; then
  step train 200 "${JAXRL[@]}" train --set run.out_dir="$DIR/.train-$DEV" \
    --set run.progress=false "${TRAIN[@]}"
fi
wait
step replay 260 "${JAXRL[@]}" bench replay --presets "$PRESETS" --policies bf16,fp32 --cost \
  --traced "${REPLAY[@]}" --out "$DIR/replay-$DEV.json"
fi

NAME="$NAME" STEPS="$STEPS" DIR="$DIR" DEV="$DEV" TAG="$TAG" SECONDS_ALL=$(( $(date +%s) - t0 )) \
"$PYTHON" - >> "$LOG" 2>&1 <<'PY'
import json, os, pathlib
import jax
d = pathlib.Path(os.environ["DIR"]); dev = os.environ["DEV"]
steps = {}
for line in open(os.environ["STEPS"]):
    name, rc, secs, last, cmd = line.rstrip("\n").split("\t", 4)
    steps[name] = {"exit": int(rc), "seconds": int(secs), "timed_out": rc in ("124", "137"),
                   "last_line": last[-300:], "command": cmd}
run = d / f".train-{dev}"
if (run / "summary.json").is_file():
    grpo = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r.get("phase") == "grpo"]
    summary = json.loads((run / "summary.json").read_text())
    summary.update(grpo_steps_logged=len(grpo),
                   replay_verified_steps=int(sum(r.get("replay_verified", 0) for r in grpo)),
                   max_mismatch_max_abs_dlogp=max((r.get("mismatch_max_abs_dlogp", 0.0)
                                                   for r in grpo), default=None))
    (d / f"train-{dev}.json").write_text(json.dumps(summary, indent=2) + "\n")
(d / f"{os.environ['TAG']}-{dev}.json").write_text(json.dumps({
    "device": os.environ["NAME"] or "none (dry run on CPU)", "jax": jax.__version__,
    "backend": jax.default_backend(), "seconds": int(os.environ["SECONDS_ALL"]),
    "steps": steps}, indent=2) + "\n")
PY
rm -rf "$STEPS" "$DIR/.train-$DEV"
cat "$DIR/$TAG-$DEV.json"
