"""`jaxrl-lp plan`: a config's GRPO programs compiled at full size on N simulated devices.

The GRPO step, the behaviour log-probs of a step's batch and one decode step.
Prints one JSON object: per-device bytes of parameters, optimizer state, KV
cache and each program's arguments, outputs and temporaries (XLA's memory
analysis), FLOPs and bytes (XLA's cost analysis, and a loop-aware count), and
a roofline bound on step time and decode tokens/s on `--target`, with `fits`
against its memory (`jaxrl_lp.plan`). Nothing is run and no data or weights
are read, so it takes about a minute for a small model on a laptop CPU.

The N devices are CPU devices (`--xla_force_host_platform_device_count=N`,
`JAX_PLATFORMS=cpu`), which must be set before jax starts: this command sets
them in its own process when jax has not started yet (the usual case), and
otherwise runs itself again in a child process with them.
"""

from __future__ import annotations

import json
import sys

from jaxrl_lp.cli.train import add_common, load


def add_parser(sub) -> None:
    from jaxrl_lp.plan.targets import TARGETS

    p = sub.add_parser("plan", help="per-device memory, FLOPs and a roofline of a config on a "
                                    "mesh of N simulated devices (JSON)",
                       description=__doc__.split("\n\n")[0])
    add_common(p)
    p.add_argument("--mesh", default=None,
                   help="the mesh, e.g. fsdp=8 or data=2,fsdp=2,tensor=2, its size --devices "
                        "(default: the config's run.mesh)")
    p.add_argument("--devices", type=int, required=True, help="how many devices to plan for")
    p.add_argument("--target", default="h100", help=f"the accelerator: {', '.join(TARGETS)}")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="padded prompt slots (default: the task's prompt bucket; 256 for GSM8K)")
    p.set_defaults(func=run)


def _argv(args) -> list[str]:
    """The command line of `args`, for the child process."""
    argv = ["plan", "--mesh", args.mesh, "--devices", str(args.devices), "--target", args.target]
    if args.config:
        argv += ["--config", args.config]
    for item in args.overrides:
        argv += ["--set", item]
    if args.prompt_len is not None:
        argv += ["--prompt-len", str(args.prompt_len)]
    return argv


def _mesh(args, cfg) -> str:
    mesh = args.mesh if args.mesh is not None else cfg.run.mesh
    if not mesh:
        raise ValueError("no mesh: pass --mesh (e.g. --mesh fsdp=8) or set run.mesh")
    return mesh


def run(args) -> int:
    from jaxrl_lp.plan import check_request, plan, rerun, use_simulated_devices

    if args.devices < 1:
        raise ValueError(f"--devices {args.devices} must be a positive integer")
    if args.prompt_len is not None and args.prompt_len < 1:
        raise ValueError(f"--prompt-len {args.prompt_len} must be a positive integer")
    cfg = load(args)
    args.mesh = _mesh(args, cfg)
    # Every check that needs no device, before jax starts (or a child process is made).
    check_request(cfg, args.mesh, args.devices, args.target, args.prompt_len)
    if not use_simulated_devices(args.devices):
        return rerun(_argv(args), args.devices)
    json.dump(plan(cfg, args.mesh, args.devices, args.target, prompt_len=args.prompt_len),
              sys.stdout, indent=2)
    print()
    return 0
