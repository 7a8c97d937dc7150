"""CPU smoke run at real sizes: random Qwen3-0.6B and Ouro-1.4B weights through the real programs.

- `qwen3-0.6b`: a 16-token sample (batch 2), then one GRPO step (hybrid
  log-probs, clipped Adam) on a batch of 2 sequences of 64 tokens (16 prompt
  + 48 sampled) with advantages +1 and -1.
- `ouro-1.4b`: a 16-token sample (batch 2) in deferred mode with the model's
  own exit rule (`threshold:1.0`, as an Ouro checkpoint reads out).

Any model preset is a part, run as the one of its kind above: `--parts
tiny-qwen3,tiny-ouro` runs the same programs in seconds (what CI runs).

Each part runs in its own child process (so its peak RSS, from
`resource.getrusage`, is its own and its memory is returned afterwards). Every
program is called twice: `first_s` includes XLA's compile, `second_s` is the
run alone. Weights are random (`init_params`), so no checkpoint is needed;
the policy is the configs' default, `bf16` (carried as f32 on CPU). The
Qwen3-0.6B part's memory holds the weights, Adam moments, gradients and the
sampler's per-layer copy; the parts' times and peaks on a CPU: docs/scale.md,
"At real sizes on CPU".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.numerics.policy import PRESETS, Policy, policy_arg

__all__ = ["PARTS", "add_arguments", "run", "run_part"]

PARTS = ("qwen3-0.6b", "ouro-1.4b")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="comma-separated model presets to run (a dense one samples and "
                             "takes a GRPO step, a looped one samples in deferred mode; "
                             "tiny-qwen3,tiny-ouro for a check in seconds)")
    parser.add_argument("--policy", default="bf16", type=policy_arg, help="the precision policy")


def _timed(fn):
    """(seconds of the first call, seconds of the second, the second call's result)."""
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    t1 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return t1 - t0, time.perf_counter() - t1, out


def _sample(params, cfg, policy, new: int, loop=None):
    import jax
    import numpy as np

    from jaxrl_lp.rollout import LoopSpec, SamplingConfig, generate

    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16)).tolist()
    return lambda: generate(params, cfg, prompts, policy=policy, max_new_tokens=new,
                            sampling=SamplingConfig(temperature=1.0), key=jax.random.key(0),
                            loop=loop or LoopSpec(), pad_id=cfg.pad_token_id or 0)


def _check_parts(parts) -> None:
    from jaxrl_lp.models.config import PRESETS

    if bad := [p for p in parts if p not in PRESETS]:
        raise ValueError(f"unknown smoke part(s) {bad}; choose model presets from {sorted(PRESETS)}")


def run_part(part: str | ModelConfig, policy: Policy = PRESETS["bf16"]) -> dict:
    """Runs one part in this process; its timings (seconds) and peak RSS (bytes).

    Args:
      part: a model preset's name (`PARTS`), or a model config: the tests run the
        presets' own widths and head shapes at one layer and a small vocabulary.
      policy: the precision policy of every program.
    """
    import jax
    import jax.numpy as jnp
    import optax

    from jaxrl_lp.models.config import get_preset
    from jaxrl_lp.models.model import init_params
    from jaxrl_lp.rl.loss import LossConfig
    from jaxrl_lp.rl.train_step import make_grpo_step
    from jaxrl_lp.rollout import LoopSpec

    if isinstance(part, str):
        _check_parts([part])
    cfg = get_preset(part) if isinstance(part, str) else part
    t0 = time.perf_counter()
    params = jax.block_until_ready(init_params(cfg, jax.random.PRNGKey(0)))
    out = {"params": cfg.param_count(), "policy": str(policy), "init_s": time.perf_counter() - t0}
    if cfg.is_looped:
        loop = LoopSpec("model", "deferred")
        first, second, ro = _timed(_sample(params, cfg, policy, 16, loop))
        out["sample_16"] = {"batch": 2, "loop": str(ro.loop), "first_s": first,
                            "second_s": second, "loop_evals": int(ro.loop_evals),
                            "tokens_per_s": 2 * 16 / second}
    else:
        first, second, ro = _timed(_sample(params, cfg, policy, 16))
        out["sample_16"] = {"batch": 2, "first_s": first, "second_s": second,
                            "tokens_per_s": 2 * 16 / second}
        ro = _sample(params, cfg, policy, 48)()  # 16 + 48 = 64 tokens a sequence
        opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-6))
        step = make_grpo_step(cfg, policy, LossConfig(), opt, method="hybrid")
        state = {"params": params, "opt": opt.init(params)}
        del params
        adv = jnp.asarray([1.0, -1.0])

        def update():
            state["params"], state["opt"], m = step(state["params"], state["opt"], ro, adv,
                                                    ro.logprobs)
            return m

        first, second, m = _timed(update)
        out["grpo_step"] = {"batch": 2, "tokens": ro.prompt_tokens.shape[1]
                            + ro.completion_tokens.shape[1], "first_s": first,
                            "second_s": second, "loss": float(m["loss"]),
                            "grad_norm": float(m["grad_norm"]), "skipped": float(m["skipped"])}
    # ru_maxrss is in KiB on Linux.
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def run(args) -> dict:
    """Runs each part of `--parts` in a child process; their results by part."""
    parts = [p for p in args.parts.split(",") if p]
    _check_parts(parts)
    out = {"machine": {"cpus": os.cpu_count(), "arch": platform.machine(),
                       "python": platform.python_version()}}
    for part in parts:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "jaxrl_lp.bench.smoke", part, str(args.policy)],
                              capture_output=True, text=True, check=False)
        if proc.returncode:
            raise RuntimeError(f"smoke part {part} failed:\n{proc.stderr[-3000:]}")
        out[part] = dict(json.loads(proc.stdout.strip().splitlines()[-1]),
                         wall_s=time.perf_counter() - t0)
    return out


if __name__ == "__main__":
    print(json.dumps(run_part(sys.argv[1], policy_arg(sys.argv[2] if len(sys.argv) > 2 else "bf16"))))
