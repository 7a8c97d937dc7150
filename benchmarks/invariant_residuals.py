"""Whether one invariant forward could give an update both its value and its gradient.

    python benchmarks/invariant_residuals.py --out docs/bench/invariant-residuals-2core-zen3.json

A later minibatch's invariant update runs two programs (docs/design/invariant.md, "The
forms"): the invariant forward for its value, forward only, and the dense forward and
backward for its gradient. One forward would serve both if the invariant forward, jitted
with the residuals of its own backward kept (`jax.vjp`'s pullback as the program's
output), still gave the sampler's bits. For the model part's cases of
`benchmarks/batch_invariance.py` (hidden 512, 2 layers, vocabulary 2048, 8 rows of up to
24 new tokens, temperature 0.8; dense and looped deferred, f32 and bf16) this prints the
completion tokens whose log-prob differs from the sampler's, with the residuals kept and
for the forward-only program the step runs (`jit_learner_logprobs(..., "invariant")`).
"""

import argparse
import os
import platform
import sys
import time

import jax
import numpy as np

import jaxrl_lp  # noqa: F401 - its XLA flag before the first computation

sys.path.insert(0, os.path.dirname(__file__))
from _xla_ops import emit  # noqa: E402
from batch_invariance import _cpu_name, _differ, _sampled  # noqa: E402


def residuals(quick: bool) -> dict:
    from jaxrl_lp.models.remat import Remat
    from jaxrl_lp.numerics.invariant import COMPILER_OPTIONS, invariant_forms, opaque_zero
    from jaxrl_lp.rl.logprob_programs import jit_learner_logprobs
    from jaxrl_lp.rl.logprobs import _dense_logprobs

    out = {}
    cases = [("dense", "fp32")] if quick else [
        (k, p) for k in ("dense", "looped_deferred") for p in ("fp32", "bf16")]
    for kind, pol in cases:
        cfg, policy, params, ro, loop = _sampled(kind, pol)
        loop = loop if cfg.is_looped else None

        def with_residuals(p, ro, cfg=cfg, policy=policy, loop=loop):
            def values(q):
                with invariant_forms(opaque_zero(ro.weights_version), ro.invariant_form):
                    return _dense_logprobs(q, cfg, policy, ro, loop, Remat.NONE, None, True)[0]
            return jax.vjp(values, p)

        kept, pullback = jax.jit(with_residuals, compiler_options=COMPILER_OPTIONS)(params, ro)
        alone = jit_learner_logprobs(cfg, policy, "invariant", loop=loop)(params, ro)
        mask = np.asarray(ro.completion_mask) > 0
        want = np.asarray(ro.logprobs)[mask]
        out[f"{kind} {pol}"] = {
            "tokens": int(mask.sum()), "residual_arrays": len(jax.tree.leaves(pullback)),
            "differing_forward_only": _differ(np.asarray(alone)[mask], want),
            "differing_with_residuals": _differ(np.asarray(kept)[mask], want)}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="dense f32 only")
    ap.add_argument("--out", help="also write the JSON to this file")
    args = ap.parse_args()
    result = {"script": "benchmarks/invariant_residuals.py", "date": time.strftime("%Y-%m-%d"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {_cpu_name()}",
              "jax": jax.__version__, "cases": residuals(args.quick)}
    emit(result, args.out)


if __name__ == "__main__":
    main()
