"""The kernels on the device this runs on: compiled on TPU (Mosaic, `k=on`), retired on GPU.

On a TPU every kernel is compiled and checked against its reference at the
presets' shapes. On CPU the same test bodies run the TPU versions in Pallas
interpret mode (`k=interpret-tpu`) at small shapes, in the default suite, so a
broken call cannot hide behind a skip. On a GPU our versions (Pallas on the
deprecated Triton backend) are retired from compiled use
(`kernels.dispatch.RETIRED`): the GPU cells check that `k=auto` runs the
reference there and `k=on` is a clear error (on CPU, that `k=on` refuses: no
compiled version). The fixed-tile product (`kernels.fixed_tile`, Mosaic GPU and Mosaic TPU)
is compiled on either device and interpreted elsewhere. Part of the GPU tier (`pytest -m
gpu`, `benchmarks/gpu.sh`).
Tolerances are the interpret tests' (stated per test); quantization is bit for
bit.
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

ON_TPU = jax.default_backend() == "tpu"
ON_GPU = jax.default_backend() in ("gpu", "cuda")
# The TPU versions: compiled on a TPU, interpreted elsewhere (at small shapes).
MODE = "on" if ON_TPU else "interpret-tpu"
pytestmark = pytest.mark.gpu
tpu_versions = pytest.mark.skipif(ON_GPU, reason="the GPU versions are retired from compiled "
                                  "use (kernels.dispatch.RETIRED): the GPU cells below check that")


def _sizes(device, small):
    """The shapes a cell runs at: the presets' on a TPU, small ones interpreted."""
    return device if ON_TPU else small


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


@tpu_versions
@pytest.mark.parametrize("t,d,v", _sizes([(256, 1024, 151936), (200, 2048, 49152),
                                          (8, 1024, 151936)],
                                         [(40, 128, 4000), (8, 128, 1000)]))
def test_fused_logprob_compiled_matches_the_reference(t, d, v):
    """f32: values within 1e-5 + 1e-6 relative, gradients within 1e-5 + 1e-4 relative of the
    reference scan (k=off), at the presets' read-out shapes (Qwen3's ragged last tile, a
    decode step's 8 rows)."""
    h, w, tokens, mask, g = _logprob_inputs(t, d, v, jnp.float32)
    (lp, ent), (dh, dw) = _value_and_grads(Policy.parse(f"fp32,k={MODE}"), h, w, tokens, mask, g)
    (lp0, ent0), (dh0, dw0) = _value_and_grads(Policy.parse("fp32,k=off"), h, w, tokens, mask, g)
    np.testing.assert_allclose(lp, lp0, atol=1e-5, rtol=1e-6)
    np.testing.assert_allclose(ent, ent0, atol=1e-5, rtol=1e-6)
    np.testing.assert_allclose(dh, dh0, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(dw, dw0, atol=1e-5, rtol=1e-4)


@tpu_versions
def test_fused_logprob_compiled_in_native_bf16():
    """bf16 h and W (what a native-bf16 run hands the kernel): within 3e-5 of the reference fed
    the same bf16 arrays on values; gradients within one bf16 ulp (2^-7 relative)."""
    h, w, tokens, mask, g = _logprob_inputs(*_sizes((256, 1024, 151936), (40, 128, 4000)),
                                            jnp.bfloat16)
    (lp, ent), (dh, dw) = _value_and_grads(Policy.parse(f"bf16,k={MODE}"), h, w, tokens, mask, g)
    (lp0, ent0), (dh0, dw0) = _value_and_grads(Policy.parse("bf16,k=off"), h, w, tokens, mask, g)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(lp, lp0, atol=3e-5, rtol=1e-6)
    np.testing.assert_allclose(ent, ent0, atol=3e-5, rtol=1e-6)
    for a, b in ((dh, dh0), (dw, dw0)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=1e-6, rtol=2**-7)


@tpu_versions
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("shape,axis", _sizes([((2560, 9728), 0), ((4096, 2560), 1),
                                               ((96, 200), 0)],
                                              [((320, 200), 0), ((40, 320), 1), ((96, 200), 0)]))
def test_quantize_compiled_is_bit_equal(fmt, shape, axis):
    """Codes, scales, tensor scale and the dequantized values, bit for bit (ragged tiles too)."""
    spec = formats.FORMATS[fmt]
    if shape[axis] % spec.block_size:
        shape = (shape[0] // spec.block_size * spec.block_size, shape[1]) if axis == 0 else shape
    x = (3 * jax.random.normal(jax.random.PRNGKey(1), shape)).astype(jnp.bfloat16)
    q = jax.jit(lambda x: kq.quantize(x, fmt, axis, kernels=MODE))(x)
    q0 = jax.jit(lambda x: formats.quantize(x, fmt, axis))(x)
    for a, b in ((q.codes, q0.codes), (q.scales, q0.scales)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    if q0.tensor_scale is not None:
        np.testing.assert_array_equal(np.asarray(q.tensor_scale), np.asarray(q0.tensor_scale))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda q: kq.dequantize(q, kernels=MODE))(q0)),
                                  np.asarray(jax.jit(dequantize_reference)(q0)))


@tpu_versions
@pytest.mark.parametrize("policy,atol", [("fp32", 1e-6), ("bf16", 2e-2)])
@pytest.mark.parametrize("b,h,k,s,dh", _sizes([(8, 16, 8, 1024, 128), (4, 32, 8, 700, 128)],
                                              [(2, 4, 2, 300, 64)]))
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
    ref_policy = Policy.parse(policy)
    out = run(Policy.parse(f"{policy},k={MODE}"))
    ref = jax.jit(lambda *a: attention(*a, ref_policy))(q, kc, vc, q_pos, k_pos)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=atol)


@pytest.mark.parametrize("kind", ["dense", "looped_deferred"])
def test_replay_equals_the_sampler_with_the_platforms_kernels(kind):
    """The exactness cell on the device, native bf16, the platform's kernels (`k=auto`: on TPU
    the Mosaic kernels, on a GPU XLA's own): replay == sampler bit for bit, whole and halves."""
    from jaxrl_lp.bench.exactness import exactness_model, exactness_rollout
    from jaxrl_lp.rollout.generate import take_rows
    from jaxrl_lp.rollout.replay import replay_logprobs

    policy = Policy.parse("bf16,k=auto")
    cfg, params, loop = exactness_model(kind, loop_steps=4)
    ro = exactness_rollout(params, cfg, policy, loop, prompts=((1, 5, 7), (2, 9, 4, 11)),
                           num_samples=2, max_new_tokens=8)
    mask = np.asarray(ro.completion_mask) > 0
    halves = [replay_logprobs(params, cfg, policy, take_rows(ro, np.arange(i, i + 2)))
              for i in (0, 2)]
    for got in (replay_logprobs(params, cfg, policy, ro), jnp.concatenate(halves)):
        np.testing.assert_array_equal(np.asarray(got)[mask], np.asarray(ro.logprobs)[mask])


@pytest.mark.skipif(ON_TPU, reason="a TPU compiles its versions (the cells above)")
@pytest.mark.parametrize("kernel", ["logprob", "quantize", "decode_attention"])
def test_a_gpu_takes_the_reference_and_refuses_kernels_on(kernel):
    """On a GPU `k=auto` runs the reference (bit-equal to `k=off`) and `k=on` is one clear
    error naming the retirement, raised when the program is compiled; on CPU the same, the
    error naming the platform without a compiled version."""
    from jaxrl_lp.kernels import KernelUnavailableError

    def call(mode):
        pol = Policy.parse(f"bf16,k={mode}")
        if kernel == "logprob":
            h, w, tokens, mask, _ = _logprob_inputs(64, 256, 4096, jnp.bfloat16)
            return jax.jit(lambda h, w: fused_logprobs(h, w, tokens, 0.7, pol, mask_T=mask))(h, w)
        if kernel == "quantize":
            x = jax.random.normal(jax.random.PRNGKey(1), (256, 512)).astype(jnp.bfloat16)
            return jax.jit(lambda x: kq.quantize(x, "mxfp8", 0, kernels=mode).codes)(x)
        ks = jax.random.split(jax.random.PRNGKey(2), 3)
        q = jax.random.normal(ks[0], (4, 1, 8, 64)).astype(jnp.bfloat16)
        kc = jax.random.normal(ks[1], (4, 4, 256, 64)).astype(jnp.bfloat16)
        vc = jax.random.normal(ks[2], (4, 4, 256, 64)).astype(jnp.bfloat16)
        k_pos = jnp.broadcast_to(jnp.arange(256), (4, 256))
        return jax.jit(lambda *a: decode_attention(*a, pol))(q, kc, vc, jnp.full((4, 1), 255),
                                                             k_pos)

    for a, b in zip(jax.tree.leaves(call("auto")), jax.tree.leaves(call("off")), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(KernelUnavailableError, match="retired" if ON_GPU else "cpu"):
        jax.block_until_ready(call("on"))


@pytest.mark.parametrize("k,n", _sizes([(1024, 3072), (3072, 1024)], [(200, 150)]))
def test_fixed_tile_product_keeps_a_rows_bits(k, n):
    """`kernels.fixed_tile` on the device (Mosaic GPU on a GPU, Mosaic TPU on a TPU), within
    bf16 summation of the f32 product, and a decode's 32 rows (b, t) of the learner's 32 x 48
    keep their bits, each moved from place b x 48 + t among 1,536 rows to place b among 32
    (what the invariant forms need of it). Elsewhere the GPU version interpreted, small, its
    rows kept at their places in the tile (tests/test_fixed_tile.py says why)."""
    from jaxrl_lp.kernels.fixed_tile import fixed_tile_product

    compiled = ON_GPU or ON_TPU
    b, t = (32, 48) if compiled else (5, 26)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((b * t, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    product = jax.jit(lambda a, w: fixed_tile_product(a, w, interpret=None if compiled else "gpu"))
    full = np.asarray(product(x, w))
    want = np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest"))
    np.testing.assert_allclose(full, want, rtol=0, atol=4e-6 * np.abs(want).max())
    for rows in ([np.arange(b) * t + step for step in (0, t - 1)] if compiled
                 else [np.arange(b)]):
        alone = np.asarray(product(x[rows], w))
        np.testing.assert_array_equal(alone.view(np.uint32), full[rows].view(np.uint32))
