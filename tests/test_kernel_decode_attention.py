"""The flash-decoding kernel (`kernels.decode_attention`) against `models.layers.attention`.

Interpret mode on CPU. Tolerances: fp32 1e-6 absolute (the same f32 maths,
another summation order); bf16 one bf16 ulp of the output's scale (2e-2
absolute on values of order 1: the kernel rounds the unnormalized weights, the
reference the normalized ones, as `kernels.decode_attention` states). The
sampler and the replay both run the kernel, so they stay bit-equal
(tests/test_kernels_logprob.py's exactness cells run with `k=interpret`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_helpers import pallas_kernels

from jaxrl_lp.kernels import KernelUnavailableError, kernel_backend
from jaxrl_lp.kernels.decode_attention import chunk_slots, decode_attention
from jaxrl_lp.kernels.dispatch import pow2_misfit, within_limits
from jaxrl_lp.models.layers import attention
from jaxrl_lp.numerics.policy import Policy


def _case(b=3, t=1, h=4, kh=2, s=40, dh=16, seed=0, dtype=jnp.float32):
    """Queries at positions 20..; slots written to `s - 6`, two padding slots, one padding query."""
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(k[0], (b, t, h, dh)).astype(dtype)
    ck = jax.random.normal(k[1], (b, kh, s, dh)).astype(dtype)
    cv = jax.random.normal(k[2], (b, kh, s, dh)).astype(dtype)
    slots = jnp.broadcast_to(jnp.arange(s), (b, s))
    k_pos = jnp.where(slots < s - 6, slots - 2, -1).at[:, :2].set(-1)  # left padding, empty tail
    q_pos = jnp.broadcast_to(20 + jnp.arange(t), (b, t)).at[0, 0].set(-1)  # a padding query
    return q, ck, cv, q_pos, k_pos


@pytest.mark.parametrize("shape,chunk", [
    (dict(), None), (dict(h=6, kh=2, s=37), 16), (dict(t=3, h=2, kh=2, s=64), 32)])
def test_fp32_kernel_matches_the_reference(shape, chunk):
    q, ck, cv, q_pos, k_pos = _case(**shape)
    ref = attention(q, ck, cv, q_pos, k_pos, Policy.parse("fp32"))
    out = decode_attention(q, ck, cv, q_pos, k_pos, "fp32,k=interpret", chunk=chunk)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(out, ref, atol=1e-6, rtol=0)
    assert float(jnp.abs(ref).max()) > 0.5


def test_bf16_kernel_is_within_one_ulp_of_the_reference_and_deterministic():
    q, ck, cv, q_pos, k_pos = _case(s=48, dtype=jnp.bfloat16)
    pol = Policy.parse("bf16,k=interpret")
    ref = attention(q, ck, cv, q_pos, k_pos, Policy.parse("bf16"))
    out = decode_attention(q, ck, cv, q_pos, k_pos, pol, chunk=16)
    assert out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2, rtol=0)
    again = decode_attention(q, ck, cv, q_pos, k_pos, pol, chunk=16)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(again, np.float32))


def test_the_policy_picks_the_kernel_in_the_decode_step_only():
    """`attend` runs the kernel for a one-token chunk under k=interpret, never under k=off."""
    q, ck, cv, q_pos, k_pos = _case()
    for pol, want in (("fp32,k=interpret", ["decode_attention"]), ("fp32,k=off", []),
                      ("fp32", [] if kernel_backend() is None else ["decode_attention"])):
        got = pallas_kernels(lambda *a, pol=pol: decode_attention(*a, pol), q, ck, cv, q_pos,
                             k_pos)
        assert got == want, pol


def test_differentiating_the_kernel_is_an_explicit_error():
    q, ck, cv, q_pos, k_pos = _case()
    f = lambda q: jnp.sum(decode_attention(q, ck, cv, q_pos, k_pos, "fp32,k=interpret"))
    with pytest.raises(NotImplementedError, match="no gradient"):
        jax.grad(f)(q)


def test_chunking_rule_and_compiled_shape_limits():
    assert [chunk_slots(s) for s in (1, 40, 130, 4096, 100_000)] == [16, 16, 32, 512, 512]
    assert pow2_misfit(head_dim=128, chunk=16) is None
    assert "head_dim=96" in pow2_misfit(head_dim=96, chunk=16)
    assert pow2_misfit(1, tile=4) is None and "tile=5" in pow2_misfit(1, tile=5)
    # auto falls back to the reference where a compiled kernel cannot take the shape; on refuses
    assert within_limits("kernel", "fp32", "x", "head_dim=96 ...") == "reference"
    assert within_limits("interpret", "fp32,k=interpret", "x", "head_dim=96 ...") == "interpret"
    with pytest.raises(KernelUnavailableError, match="head_dim=96"):
        within_limits("kernel", "fp32,k=on", "x", "head_dim=96 is not a power of two")


@pytest.mark.skipif(kernel_backend() is not None, reason="a Pallas backend is present")
def test_kernels_on_without_pallas_backend_is_one_clear_error():
    q, ck, cv, q_pos, k_pos = _case()
    with pytest.raises(KernelUnavailableError, match="kernels=interpret"):
        decode_attention(q, ck, cv, q_pos, k_pos, "fp32,k=on")
