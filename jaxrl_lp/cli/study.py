"""`jaxrl-lp study NAME`: the numerics studies built into the library (SPEC sections 5 and 7).

Targets:
  fair-cast       bf16 export by nearest / stochastic / error-feedback rounding against
                  an f32 reference, on the same short GRPO run (`jaxrl_lp.studies.fair_cast`).
  ternary-export  a ternary (BitNet b1.58) model exported by the three paths
                  (`jaxrl_lp.studies.ternary_export`).

Each prints its result as JSON and writes it (and plots) under `--out`
(default `runs/study-<name>`), replacing what is there.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from jaxrl_lp.cli.help import show_defaults

STUDIES = ("fair-cast", "ternary-export")


def add_parser(sub) -> None:
    p = sub.add_parser("study", help="run a built-in numerics study (fair-cast, ternary-export)",
                       description=__doc__.split("\n\n", 1)[1].split("\n\nEach")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=STUDIES, help="the study")
    p.add_argument("--out", default=None, help="output directory (default runs/study-<name>)")
    p.add_argument("--steps", type=int, default=None,
                   help="fair-cast: GRPO steps per arm (default 40; 3 with --quick)")
    p.add_argument("--sft-steps", type=int, default=None,
                   help="warm-start steps (default: fair-cast the default config's, "
                        "ternary-export 2000)")
    p.add_argument("--lr", type=float, default=None, help="fair-cast: GRPO learning rate (default 1e-6)")
    p.add_argument("--arms", default=None,
                   help="fair-cast: comma-separated subset of f32,nearest,stochastic,error_feedback "
                        "(default: all)")
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
    out = args.out or f"runs/study-{args.name}"
    _compilation_cache()
    if args.name == "fair-cast":
        from jaxrl_lp.studies.fair_cast import ARMS, DEFAULT_LR, DEFAULT_STEPS, run_fair_cast

        arms = tuple(a.strip() for a in args.arms.split(",") if a.strip()) if args.arms else ARMS
        if not arms or set(arms) - set(ARMS):
            raise UserError(f"--arms {args.arms!r}: choose from {','.join(ARMS)}")
        result = run_fair_cast(
            out, steps=args.steps or (3 if args.quick else DEFAULT_STEPS), arms=arms,
            sft_steps=args.sft_steps, lr=args.lr or DEFAULT_LR, overrides=tuple(args.overrides),
            quick=args.quick, progress=args.progress)
    else:
        if args.steps is not None or args.lr is not None or args.arms is not None:
            raise UserError("--steps, --lr and --arms apply to fair-cast only (ternary-export "
                            "has no GRPO phase)")
        from jaxrl_lp.studies.ternary_export import run_ternary_export

        result = run_ternary_export(out, sft_steps=args.sft_steps, overrides=tuple(args.overrides),
                                    quick=args.quick, progress=args.progress)
    print(json.dumps(result, indent=2))
    return 0
