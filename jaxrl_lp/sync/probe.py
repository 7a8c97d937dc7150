"""Check 7: the learner's served-copy forward and the sampler's forward on fixed probe tokens.

`probe_logprobs` runs one plain forward (jitted; `cfg` and `policy` static) and
returns the log-probs of each next probe token. `check_probe_logprobs` compares
the two sides: bit-equal when the run pairs matched policies, else within
`atol` (default `PROBE_ATOL` = 0.05 nats: a bf16 forward and an f32 forward of a
small model stay within it; set it for your model and policies).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.models.model import forward
from jaxrl_lp.numerics.policy import Policy, require
from jaxrl_lp.sync.report import CheckResult, result

__all__ = ["PROBE_ATOL", "check_probe_logprobs", "probe_logprobs"]

# Check 7's tolerance (nats) between learner and sampler probe log-probs for unmatched policies.
PROBE_ATOL = 0.05


@functools.partial(jax.jit, static_argnames=("cfg", "policy"))
def _probe(params, tokens_BxT, *, cfg, policy):
    logits, _, _ = forward(params, cfg, policy, tokens_BxT)
    lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(lp, tokens_BxT[:, 1:, None], axis=-1)[..., 0]


def probe_logprobs(params_dense: Any, cfg: Any, policy: Policy, tokens_BxT: Any) -> jax.Array:
    """Log-probs [B, T-1] (f32) of `tokens[:, 1:]` under one plain forward (jitted; cfg
    and policy static)."""
    return _probe(params_dense, jnp.asarray(tokens_BxT, jnp.int32), cfg=cfg,
                  policy=require(policy, "probe_logprobs"))


def check_probe_logprobs(learner_lp: Any, sampler_lp: Any, *, matched: bool = True,
                         atol: float = PROBE_ATOL, mask: Any = None,
                         learner_policy: Policy | None = None,
                         sampler_policy: Policy | None = None) -> CheckResult:
    """Check 7: probe log-probs bit-equal (matched policies) or within `atol` nats."""
    a, b = np.asarray(learner_lp, np.float32), np.asarray(sampler_lp, np.float32)
    if a.shape != b.shape:
        return CheckResult("probe_logprobs", False, f"shapes differ: {a.shape} vs {b.shape}")
    keep = np.ones(a.shape, bool) if mask is None else np.asarray(mask) > 0
    problems = []
    if matched and learner_policy is not None and sampler_policy is not None \
            and learner_policy != sampler_policy:
        problems.append(f"sampler runs policy {sampler_policy} but the learner "
                        f"runs {learner_policy} and the run expects them matched")
    diff = np.abs(a - b)[keep]
    worst = float(np.nanmax(diff, initial=0.0)) if not np.isnan(diff).all() else float("nan")
    if np.isnan(diff).any():
        problems.append(f"{int(np.isnan(diff).sum())} NaN log-prob difference(s)")
    if matched and a[keep].tobytes() != b[keep].tobytes():
        problems.append(f"log-probs not bit-equal under matched policies: max |delta| {worst:.3g} "
                        f"over {int(keep.sum())} tokens")
    if not matched and worst > atol:
        problems.append(f"max |delta logp| {worst:.3g} exceeds the tolerance {atol}")
    ok = "bit-equal" if matched else f"max |delta logp| {worst:.3g} <= {atol}"
    return result("probe_logprobs", problems, f"{ok} over {int(keep.sum())} probe tokens")
