"""The exactness cells with low precision stored natively, as on GPU and TPU, here on CPU.

On CPU a bf16 compute dtype is carried as f32 arrays of bf16 values
(docs/design/low_precision.md, "Low precision on CPU"); on GPU and TPU the arrays are bf16
(a policy's `s=native` selects that path anywhere, `plan.programs.native`).
Before a device sees it,
the bf16-stored path is proven here at tiny sizes, kernels off and in Pallas
interpret mode (the GPU and the TPU versions): the replay equals the sampler
bit for bit, the hybrid log-probs' value is the sampler's and their gradient
the dense one's, exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import exactness_grads

from jaxrl_lp.bench.exactness import exactness_model, exactness_rollout, masked_max_abs_diff
from jaxrl_lp.numerics.policy import Policy

PROMPTS = ((1, 5, 7), (2, 9, 4, 11, 3, 8), (6,))


# By default the dense model without kernels (27 s cold on the 2-core Zen 3); the other
# cells, the looped one (deferred) with the GPU kernels among them (40 s), in the slow tier.
@pytest.mark.parametrize("kind,kernels", [
    ("dense", "off"),
    *(pytest.param(k, m, marks=pytest.mark.slow) for k, m in (
        ("looped_deferred", "interpret"), ("dense", "interpret"), ("dense", "interpret-tpu"),
        ("looped_deferred", "off"),
        ("looped_deferred", "interpret-tpu"),
        ("looped_dense", "off"), ("looped_dense", "interpret")))])
def test_replay_and_hybrid_are_exact_with_bf16_stored(kind, kernels):
    cfg, params, loop = exactness_model(kind, loop_steps=4)
    policy = Policy.parse(f"bf16,k={kernels},s=native")
    assert policy.native
    ro = exactness_rollout(params, cfg, policy, loop, prompts=PROMPTS, num_samples=2,
                           max_new_tokens=8)
    traced = jax.jit(exactness_grads(cfg, policy, ro, loop)).trace(params)
    # The bf16 path is the one traced: activations are bf16 arrays, not f32 carriers.
    assert "bf16" in str(traced.jaxpr)
    (g_hybrid, hybrid), (g_dense, dense), replay = traced.lower().compile()(params)
    mask = ro.completion_mask
    assert float(jnp.sum(mask)) > len(PROMPTS) * 2  # the rollout is not trivial
    assert masked_max_abs_diff(replay, ro.logprobs, mask) == 0.0
    assert masked_max_abs_diff(hybrid, ro.logprobs, mask) == 0.0
    # Dense is a different computation (one parallel forward): close, not equal, in bf16, so
    # the hybrid's value (the sampler's, above) is not dense's. Measured on XLA:CPU over the
    # eight cells: max |dlogp| 1.1e-3 to 1.0e-2 (14-41 of 45-46 tokens differ); the tolerance
    # is about 4x the largest.
    assert 0.0 < masked_max_abs_diff(dense, ro.logprobs, mask) < 4e-2
    for a, b in zip(jax.tree.leaves(g_hybrid), jax.tree.leaves(g_dense), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert max(float(jnp.abs(a).max()) for a in jax.tree.leaves(g_hybrid)) > 0.0
