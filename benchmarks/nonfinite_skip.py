"""What the learner's non-finite skip costs: the optimizer update alone, three ways.

Prints one JSON object: the time of one jitted, donated update of a dense
preset's parameters (clip_by_global_norm(1.0) + adam(1e-6), the learner
bench's optimizer), fastest of `--repeats`, the forms alternating:

- `cond`: `rl.train_step._apply_if_finite`, the GRPO step's skip (the new
  parameters reduced to "all finite", then the update under `lax.cond`);
- `where`: `rl.train_step._select_if_finite`, the same rule applied by
  `jnp.where` over the parameters and the Adam moments after the update (the
  SFT step's skip, and the GRPO step's before);
- `none`: the update with no skip at all (the floor).

It also counts, on the default run's model, the parameters whose bits differ
between the two skips after 5 updates of the warm-start's AdamW with its
warmup-cosine schedule and of the GRPO step's clipped Adam
(`bits_differing`): the reason the SFT step keeps the selection.

    python benchmarks/nonfinite_skip.py [--preset small-qwen3] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_lp.models.config import get_preset
from jaxrl_lp.models.model import init_params
from jaxrl_lp.rl.train_step import _apply_if_finite, _select_if_finite


def _none(optimizer, grads, opt_state, params, loss):
    updates, new_opt = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_opt, jnp.isfinite(loss)


def _bits_differing(steps: int = 5) -> dict:
    from jaxrl_lp.train.defaults import default_config

    params = init_params(default_config().model, jax.random.PRNGKey(0))
    grads = jax.tree.map(lambda x: 0.01 * jnp.sin(1000.0 * x), params)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 10, 1200)
    out = {"params": int(sum(x.size for x in jax.tree.leaves(params)))}
    for name, opt in (("adamw_cosine", optax.adamw(schedule, weight_decay=0.0)),
                      ("clip_adam", optax.chain(optax.clip_by_global_norm(1.0),
                                                optax.adam(1e-4)))):
        ends = []
        for apply in (_apply_if_finite, _select_if_finite):
            fn = jax.jit(lambda p, o, g, apply=apply, opt=opt: apply(opt, g, o, p,
                                                                     jnp.float32(1.0))[:2])
            p, o = params, opt.init(params)
            for _ in range(steps):
                p, o = fn(p, o, grads)
            ends.append(p)
        out[name] = int(sum(np.sum(np.asarray(a) != np.asarray(b))
                            for a, b in zip(*map(jax.tree.leaves, ends), strict=True)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small-qwen3")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    cfg = get_preset(args.preset)
    params = init_params(cfg, jax.random.PRNGKey(0))
    grads = jax.tree.map(lambda x: 1e-3 * x, params)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-6))
    calls = {}
    for name, apply in (("cond", _apply_if_finite), ("where", _select_if_finite), ("none", _none)):
        fn = jax.jit(lambda p, o, g, apply=apply: apply(opt, g, o, p, jnp.float32(1.0))[:2],
                     donate_argnums=(0, 1))
        state = [jax.tree.map(jnp.copy, params), opt.init(params)]

        def call(fn=fn, state=state):
            state[0], state[1] = fn(state[0], state[1], grads)
            jax.block_until_ready(state[0])
        call()  # compile
        calls[name] = call
    times = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, call in calls.items():
            t = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t)
    n_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    print(json.dumps({"preset": args.preset, "param_bytes": int(n_bytes),
                      "platform": jax.devices()[0].device_kind, "repeats": args.repeats,
                      **{f"{name}_s": round(min(ts), 4) for name, ts in times.items()},
                      "bits_differing": _bits_differing()},
                     indent=2))


if __name__ == "__main__":
    main()
