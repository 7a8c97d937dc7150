"""Synchronous against overlapped GRPO iterations, the sampler and the learner on their own devices.

Each cell places the learner and the sampler on disjoint simulated CPU devices
(`run.learner_mesh`, `run.sampler_mesh`) and trains the same short run twice,
alternately, `--rounds` times: `grpo.max_staleness=0` (sample, then update:
the learner's devices wait for the sampler's and back) and
`grpo.max_staleness=1` (step n + 1's rollout is sampled while the learner
updates on step n's). It is the training program itself (`run_train`): the
iteration time is a step's `timing_s/iteration` (what the learner's loop
waited for: export, its rollout, behaviour, updates, sync), the median over
the steps after `--warmup`, and of the rounds.

The workload (`--set`, on top of the default config): a model wider than the
default task's (hidden 256, 4 layers, 2 loop steps) from random weights (no
warm-start), so its completions run to the 64-token budget and sampling is a
real share of the step, 16 prompts x 4 samples a step. With random weights
the rewards are 0 and the advantages too; the programs compute the same.

Cells (`--cells`):
- `4+4`: learner `fsdp=4`, sampler `data=4` (four single-device sampler
  replicas) on 8 simulated devices, XLA's default threading. The 8 simulated
  devices share this machine's cores, so what overlaps is the cores' idle
  time only.
- `1+1/core`: learner and sampler on one device each, every device's programs
  single-threaded (`--xla_cpu_multi_thread_eigen=false`): a device is one
  core, as disjoint accelerators are disjoint hardware.
- `4+4/core`: the 4+4 placement single-threaded.

Each cell runs in a child process (the device count and threading are fixed
when XLA starts). JSON out: per cell and mode the iteration seconds and
their phase split, and `speedup` = synchronous / overlapped.

    jaxrl-lp bench overlap --out docs/bench/overlap-2core-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

__all__ = ["CELLS", "WORKLOAD", "add_arguments", "main"]

# name -> (learner mesh, sampler mesh, single-threaded devices)
CELLS = {
    "4+4": ("fsdp=4", "data=4", False),
    "1+1/core": ("data=1", "data=1", True),
    "4+4/core": ("fsdp=4", "data=4", True),
}
WORKLOAD = [
    "model.hidden_size=256", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
    "model.head_dim=64", "model.intermediate_size=768", "model.max_position_embeddings=96",
    "sft.steps=0", "grpo.max_new_tokens=64", "grpo.prompts_per_step=16", "grpo.group_size=4",
    "run.progress=false", "run.eval_size=8", "run.eval_every=1000",
    "run.checkpoint_every=1000",
]
PHASES = ("sample", "behaviour", "update", "export", "score", "sync")
DEVICES = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cells", default="4+4,1+1/core",
                        help=f"placements to race, comma-separated: {', '.join(CELLS)}")
    parser.add_argument("--steps", type=int, default=8, help="GRPO steps per run")
    parser.add_argument("--warmup", type=int, default=3,
                        help="first steps left out of the medians (compiles)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="synchronous/overlapped pairs per cell, alternating")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="config overrides on top of the workload")
    parser.add_argument("--out", default=None, help="also write the JSON to this file")
    parser.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # a child's cell


def _check(args) -> list[str]:
    cells = [c for c in args.cells.split(",") if c]
    for c in cells:
        if c not in CELLS:
            raise ValueError(f"--cells: unknown cell {c!r}; choose from {', '.join(CELLS)}")
    if not cells:
        raise ValueError("--cells: name at least one cell")
    if args.steps <= args.warmup:
        raise ValueError(f"--steps {args.steps} must exceed --warmup {args.warmup}: the medians "
                         "need steps after the warm-up")
    if args.warmup < 1 or args.rounds < 1:
        raise ValueError("--warmup and --rounds must be at least 1")
    return cells


def _run_once(overrides: list[str], out: str, warmup: int) -> dict:
    """One `run_train` of `overrides` into `out`; the medians of its later steps' timings."""
    from jaxrl_lp.train import apply_overrides, default_config, run_train

    shutil.rmtree(out, ignore_errors=True)
    run_train(apply_overrides(default_config(), [*overrides, f"run.out_dir={out}"]))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    steps = [r for r in recs if r.get("phase") == "grpo"][warmup:]
    med = lambda k: round(statistics.median(r.get(k, 0.0) for r in steps), 4)
    return {"iteration_s": med("timing_s/iteration"),
            **{p: med(f"timing_s/{p}") for p in PHASES},
            "rollout_staleness": med("rollout_staleness"),
            "response_length": med("response_length")}


def _child(args) -> int:
    """Runs one cell's alternating runs in this process (its devices set by the parent)."""
    import jax

    learner, sampler, _ = CELLS[args.cell]
    base = [*WORKLOAD, f"grpo.steps={args.steps}", f"run.learner_mesh={learner}",
            f"run.sampler_mesh={sampler}", *args.overrides]
    runs: dict[str, list] = {"synchronous": [], "overlapped": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for mode, k in (("synchronous", 0), ("overlapped", 1)):
                runs[mode].append(_run_once([*base, f"grpo.max_staleness={k}"],
                                            os.path.join(tmp, mode), args.warmup))
    out = {"learner_mesh": learner, "sampler_mesh": sampler, "devices": jax.device_count(),
           "xla_flags": os.environ.get("XLA_FLAGS", "")}
    for mode, rs in runs.items():
        best = min(rs, key=lambda r: r["iteration_s"])
        out[mode] = {**best, "rounds_s": [r["iteration_s"] for r in rs]}
    out["speedup"] = round(out["synchronous"]["iteration_s"]
                           / max(out["overlapped"]["iteration_s"], 1e-9), 3)
    print(json.dumps(out))
    return 0


def main(args) -> int:
    if args.cell is not None:
        return _child(args)
    cells = _check(args)
    from jaxrl_lp.plan.devices import simulated_env

    result = {"target": "overlap", "platform": f"{platform.machine()} cpu, {os.cpu_count()} cores",
              "loadavg_start": round(os.getloadavg()[0], 2), "workload": WORKLOAD,
              "overrides": args.overrides, "steps": args.steps, "warmup": args.warmup,
              "rounds": args.rounds}
    for cell in cells:
        env = simulated_env(DEVICES)
        if CELLS[cell][2]:
            env["XLA_FLAGS"] += " --xla_cpu_multi_thread_eigen=false"
        cmd = [sys.executable, "-m", "jaxrl_lp.cli.main", "bench", "overlap", "--cell", cell,
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--rounds", str(args.rounds), *(a for o in args.overrides for a in ("--set", o))]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            sys.stderr.write(done.stderr[-4000:])
            raise RuntimeError(f"bench overlap: cell {cell} failed (exit {done.returncode})")
        result[cell] = json.loads(done.stdout.strip().splitlines()[-1])
    result["loadavg_end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0
