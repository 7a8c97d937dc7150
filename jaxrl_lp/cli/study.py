"""`jaxrl-lp study NAME`: the library's numerics studies (docs/design/studies.md, "Numerics studies").

Targets:
  fair-cast          bf16 export by nearest / stochastic / error-feedback rounding against
                     an f32 reference, on the same short GRPO run (`jaxrl_lp.studies.fair_cast`).
  ternary-export     a ternary (BitNet b1.58) model exported by the three paths
                     (`jaxrl_lp.studies.ternary_export`).
  alignment          mismatch per f32 region left out of the sampler's policy, and a short
                     GRPO run per arm (`jaxrl_lp.studies.alignment`).
  backward-state     `reuse` against `fresh` backwards per matmul format: gradient
                     difference, bias against f32, loss curves (`jaxrl_lp.studies.backward_state`).
  error-diffusion    binary / ternary weights trained by the error-diffusion optimizer per
                     residual width k against a latent-weight baseline
                     (`jaxrl_lp.studies.error_diffusion`).
  matched-precision  GRPO with sampler and learner in the same FP8/FP4 format against an
                     unmatched learner with and without TIS/MIS
                     (`jaxrl_lp.studies.matched_precision`).
  staleness          off-policy GRPO at max_staleness 0, 1, 2 (and decoupled PPO at 1) on the
                     default task: gain against the synchronous run, policy change, numerics
                     mismatch (`jaxrl_lp.studies.staleness`).
  lora-mismatch      LoRA GRPO per base format (f32, bf16, MXFP8, NVFP4) served unmerged,
                     merged, and merged with the loss on the served copy: the mismatch and
                     short reward curves (`jaxrl_lp.studies.lora_mismatch`).

Each prints its result as JSON and writes it (and plots) under `--out`
(default `runs/study-<name>`), replacing what is there.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import tempfile

from jaxrl_lp.cli.help import show_defaults

# name -> (module under jaxrl_lp.studies, its run function). Every run function takes
# `(out_dir, *, steps, sft_steps, arms, overrides, quick, progress)` (None: its default)
# and returns the JSON-able result; its module's `ARMS` lists the valid `--arms`.
STUDIES: dict[str, tuple[str, str]] = {
    "fair-cast": ("fair_cast", "run_fair_cast"),
    "ternary-export": ("ternary_export", "run_ternary_export"),
    "alignment": ("alignment", "run_alignment"),
    "backward-state": ("backward_state", "run_backward_state"),
    "error-diffusion": ("error_diffusion", "run_error_diffusion"),
    "matched-precision": ("matched_precision", "run_matched_precision"),
    "staleness": ("staleness", "run_staleness"),
    "lora-mismatch": ("lora_mismatch", "run_lora_mismatch"),
}


def add_parser(sub) -> None:
    p = sub.add_parser("study", help="run a built-in numerics study (" + ", ".join(STUDIES) + ")",
                       description=__doc__.split("\n\n", 1)[1].split("\n\nEach")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=tuple(STUDIES), help="the study")
    p.add_argument("--out", default=None, help="output directory (default runs/study-<name>)")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per arm (each study's default; fair-cast 40, 3 with "
                        "--quick; ternary-export has no GRPO phase and takes none)")
    p.add_argument("--sft-steps", type=int, default=None,
                   help="warm-start steps (default: each study's own)")
    p.add_argument("--lr", type=float, default=None, help="fair-cast: GRPO learning rate (default 1e-6)")
    p.add_argument("--arms", default=None,
                   help="comma-separated subset of the study's arms (default: all; the study's "
                        "module docstring lists them)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every run of the study (repeatable)")
    p.add_argument("--quick", action="store_true", help="a tiny smoke version (seconds to minutes)")
    p.add_argument("--progress", action="store_true", help="show training progress bars")
    show_defaults(p)
    p.set_defaults(func=run)


def _compilation_cache() -> None:
    """The arms of a study compile the same programs: share them through XLA's disk cache
    (unless the user configured one with JAX_COMPILATION_CACHE_DIR)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    import jax

    jax.config.update("jax_compilation_cache_dir",
                      os.path.join(tempfile.gettempdir(), "jaxrl_lp_xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def run(args) -> int:
    from jaxrl_lp.cli.main import UserError

    if args.steps is not None and args.steps < 1:
        raise UserError(f"--steps must be at least 1; got {args.steps}")
    if args.sft_steps is not None and args.sft_steps < 0:
        raise UserError(f"--sft-steps must be non-negative; got {args.sft_steps}")
    if args.lr is not None and not args.lr > 0:
        raise UserError(f"--lr must be positive; got {args.lr}")
    if args.lr is not None and args.name != "fair-cast":
        raise UserError(f"--lr applies to fair-cast only; {args.name} sets its own learning rates "
                        "(change them with --set)")
    module_name, fn_name = STUDIES[args.name]
    module = importlib.import_module(f"jaxrl_lp.studies.{module_name}")
    arms = None
    if args.arms is not None:
        valid = tuple(getattr(module, "ARMS", ()))
        arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
        if not valid:
            raise UserError(f"--arms does not apply to {args.name} (it has no arms to choose)")
        if not arms or set(arms) - set(valid):
            raise UserError(f"--arms {args.arms!r}: choose from {','.join(valid)}")
    if args.name == "ternary-export" and args.steps is not None:
        raise UserError("--steps does not apply to ternary-export (it has no GRPO phase; "
                        "use --sft-steps)")
    out = args.out or f"runs/study-{args.name}"
    _compilation_cache()
    kwargs = dict(sft_steps=args.sft_steps, overrides=tuple(args.overrides), quick=args.quick,
                  progress=args.progress)
    if args.name == "fair-cast":
        kwargs.update(steps=args.steps or (3 if args.quick else module.DEFAULT_STEPS),
                      arms=arms or module.ARMS, lr=args.lr or module.DEFAULT_LR)
    elif args.name != "ternary-export":
        kwargs.update(steps=args.steps, arms=arms)
    result = getattr(module, fn_name)(out, **kwargs)
    print(json.dumps(result, indent=2))
    return 0
