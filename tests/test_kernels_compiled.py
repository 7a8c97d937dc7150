"""The kernels compiled on the device this runs on (`k=on`): GPU (Triton) or TPU (Mosaic).

Skipped on CPU, where the same maths is checked in Pallas interpret mode
(tests/test_kernels_logprob.py, test_kernel_logprob_tpu.py, test_kernel_quantize.py,
test_kernel_decode_attention.py) and the lowering for both platforms in
tests/test_lowering.py. `benchmarks/gpu.sh` and `benchmarks/tpu.sh` run this file on a
device. Tolerances are the interpret tests' (stated per test); quantization is bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_lp.kernels import quantize as kq
from jaxrl_lp.kernels.decode_attention import decode_attention
from jaxrl_lp.kernels.logprob import fused_logprobs
from jaxrl_lp.models.attention import attention
from jaxrl_lp.numerics import formats
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.numerics.qarray import dequantize as dequantize_reference

pytestmark = pytest.mark.skipif(
    jax.default_backend() not in ("gpu", "cuda", "tpu"),
    reason="compiles the kernels for this host's GPU or TPU (k=on); on CPU the interpret-mode "
           "tests check the same maths and tests/test_lowering.py the lowering")


def _logprob_inputs(t, d, v, dtype, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    h = jax.random.normal(k[0], (t, d)).astype(dtype)
    w = (0.05 * jax.random.normal(k[1], (d, v))).astype(dtype)
    tokens = jax.random.randint(k[2], (t,), 0, v)
    mask = (jnp.arange(t) % 4) != 1
    g = jax.random.normal(k[3], (2, t))
    return h, w, tokens, mask, g


def _value_and_grads(policy, h, w, tokens, mask, g):
    def loss(h, w):
        lp, ent = fused_logprobs(h, w, tokens, 0.7, policy, mask_T=mask)
        return jnp.sum(g[0] * lp + g[1] * ent), (lp, ent)

    (_, outs), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(h, w)
    return outs, grads


@pytest.mark.parametrize("t,d,v", [(256, 1024, 151936), (200, 2048, 49152), (8, 1024, 151936)])
def test_fused_logprob_compiled_matches_the_reference(t, d, v):
    """f32: values within 1e-5 + 1e-6 relative, gradients within 1e-5 + 1e-4 relative of the
    reference scan (k=off), at the presets' read-out shapes (Qwen3's ragged last tile, a
    decode step's 8 rows)."""
    h, w, tokens, mask, g = _logprob_inputs(t, d, v, jnp.float32)
    (lp, ent), (dh, dw) = _value_and_grads("fp32,k=on", h, w, tokens, mask, g)
    (lp0, ent0), (dh0, dw0) = _value_and_grads("fp32,k=off", h, w, tokens, mask, g)
    np.testing.assert_allclose(lp, lp0, atol=1e-5, rtol=1e-6)
    np.testing.assert_allclose(ent, ent0, atol=1e-5, rtol=1e-6)
    np.testing.assert_allclose(dh, dh0, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(dw, dw0, atol=1e-5, rtol=1e-4)


def test_fused_logprob_compiled_in_native_bf16():
    """bf16 h and W (what a native-bf16 run hands the kernel): within 3e-5 of the reference fed
    the same bf16 arrays on values; gradients within one bf16 ulp (2^-7 relative)."""
    h, w, tokens, mask, g = _logprob_inputs(256, 1024, 151936, jnp.bfloat16)
    (lp, ent), (dh, dw) = _value_and_grads("bf16,k=on", h, w, tokens, mask, g)
    (lp0, ent0), (dh0, dw0) = _value_and_grads("bf16,k=off", h, w, tokens, mask, g)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(lp, lp0, atol=3e-5, rtol=1e-6)
    np.testing.assert_allclose(ent, ent0, atol=3e-5, rtol=1e-6)
    for a, b in ((dh, dh0), (dw, dw0)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=1e-6, rtol=2**-7)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("shape,axis", [((2560, 9728), 0), ((4096, 2560), 1), ((96, 200), 0)])
def test_quantize_compiled_is_bit_equal(fmt, shape, axis):
    """Codes, scales, tensor scale and the dequantized values, bit for bit (ragged tiles too)."""
    spec = formats.FORMATS[fmt]
    if shape[axis] % spec.block_size:
        shape = (shape[0] // spec.block_size * spec.block_size, shape[1]) if axis == 0 else shape
    x = (3 * jax.random.normal(jax.random.PRNGKey(1), shape)).astype(jnp.bfloat16)
    q = jax.jit(lambda x: kq.quantize(x, fmt, axis, kernels="on"))(x)
    q0 = jax.jit(lambda x: formats.quantize(x, fmt, axis))(x)
    for a, b in ((q.codes, q0.codes), (q.scales, q0.scales)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    if q0.tensor_scale is not None:
        np.testing.assert_array_equal(np.asarray(q.tensor_scale), np.asarray(q0.tensor_scale))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda q: kq.dequantize(q, kernels="on"))(q0)),
                                  np.asarray(jax.jit(dequantize_reference)(q0)))


@pytest.mark.parametrize("policy,atol", [("fp32", 1e-6), ("bf16", 2e-2)])
@pytest.mark.parametrize("b,h,k,s,dh", [(8, 16, 8, 1024, 128), (4, 32, 8, 700, 128)])
def test_decode_attention_compiled_matches_the_reference(policy, atol, b, h, k, s, dh):
    """One query per row over a cache with left padding (position -1) and a ragged last chunk:
    f32 within 1e-6 of `models.attention.attention`, bf16 within 2e-2 (the rounding sites of
    the kernel's module docstring)."""
    ks = jax.random.split(jax.random.PRNGKey(2), 3)
    dtype = jnp.bfloat16 if policy == "bf16" else jnp.float32
    q = jax.random.normal(ks[0], (b, 1, h, dh)).astype(dtype)
    kc = jax.random.normal(ks[1], (b, k, s, dh)).astype(dtype)
    vc = jax.random.normal(ks[2], (b, k, s, dh)).astype(dtype)
    start = jnp.arange(b) * 7
    k_pos = jnp.where(jnp.arange(s)[None] >= start[:, None], jnp.arange(s)[None] - start[:, None], -1)
    q_pos = jnp.full((b, 1), s - 1) - start[:, None]
    run = lambda pol: jax.jit(lambda *a: decode_attention(*a, pol))(q, kc, vc, q_pos, k_pos)
    out, ref = run(f"{policy},k=on"), jax.jit(lambda *a: attention(*a, policy))(q, kc, vc, q_pos,
                                                                                k_pos)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=atol)


@pytest.mark.parametrize("kind", ["dense", "looped_deferred"])
def test_replay_equals_the_sampler_with_the_kernels_compiled(kind):
    """The exactness cell on the device, native bf16, kernels on: replay == sampler bit for bit."""
    from jaxrl_lp.bench.exactness import exactness_model, exactness_rollout, masked_max_abs_diff
    from jaxrl_lp.rl.logprobs import learner_logprobs

    cfg, params, loop = exactness_model(kind, loop_steps=4)
    ro = exactness_rollout(params, cfg, Policy.parse("bf16,k=on"), loop, prompts=((1, 5, 7), (2, 9, 4, 11)),
                           num_samples=2, max_new_tokens=8)
    replay, _ = jax.jit(lambda p: learner_logprobs(p, cfg, "bf16,k=on", ro, "replay",
                                                   loop=loop))(params)
    assert masked_max_abs_diff(replay, ro.logprobs, ro.completion_mask) == 0.0
