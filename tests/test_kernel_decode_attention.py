"""The flash-decoding kernel (`kernels.decode_attention`) against `models.attention.attention`.

Both versions run in Pallas interpret mode on CPU: `k=interpret` (cuda) and
`k=interpret-tpu` (tpu), with ragged last chunks, GQA and padding slots and
queries. Tolerances: fp32 1e-6 absolute (the same f32 maths, another
summation order); bf16 one bf16 ulp of the output's scale (2e-2 absolute on
values of order 1: the kernel rounds the unnormalized weights, the reference
the normalized ones, as `kernels.decode_attention` states). Gradients: the
kernel's backward is the reference's VJP recomputed, so a gradient through
the kernel equals the reference's within 1e-6 absolute in f32 (the cotangent
reaching the kernel is the same; only XLA's fusion of the recomputed
reference may differ). The sampler and the replay both run the kernel, so
they stay bit-equal (tests/test_kernels_logprob.py's exactness cells run with
`k=interpret`). A slow test runs the tpu version under Pallas's TPU
interpreter with NaN in uninitialized memory (a ragged chunk's padding).

Lowering (what a device compiler gets) is checked on abstract bf16 inputs at
the preset shapes for `tpu`; `cuda`, whose version is retired from compiled
use (`kernels.dispatch.RETIRED`), refuses `kernels=on`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_helpers import pallas_kernels

from jaxrl_lp.kernels import KernelUnavailableError
from jaxrl_lp.kernels.decode_attention import chunk_slots, decode_attention, plan_chunk
from jaxrl_lp.kernels.dispatch import pow2_misfit
from jaxrl_lp.kernels.lowering import kernel_calls, lower_for, trace_for
from jaxrl_lp.models.attention import attention
from jaxrl_lp.numerics.policy import Policy

MODES = ("interpret", "interpret-tpu")
# (B, H, K, S, Dh) lowered: the decode preset, and Qwen3-4B's heads.
LOWERED = {"preset": (8, 16, 8, 1024, 128), "qwen3_4b": (8, 32, 8, 1024, 128)}


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


def _abstract(b, h, kh, s, dh, dtype=jnp.bfloat16):
    sds = jax.ShapeDtypeStruct
    return [sds((b, 1, h, dh), dtype), sds((b, kh, s, dh), dtype), sds((b, kh, s, dh), dtype),
            sds((b, 1), jnp.int32), sds((b, s), jnp.int32)]


# ---------------------------------------------------------------- both versions against the reference
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,chunk", [
    (dict(), None),  # one chunk (cuda 16 slots: 3 chunks, the last ragged)
    (dict(h=6, kh=2, s=37), 16),  # GQA 3, ragged last chunk
    (dict(t=3, h=2, kh=2, s=64), 32),  # three query tokens
    (dict(h=8, kh=2, s=300), None)])  # the tpu plan: chunks of 128, the last 44 slots
def test_fp32_kernel_matches_the_reference(shape, chunk, mode):
    q, ck, cv, q_pos, k_pos = _case(**shape)
    ref = attention(q, ck, cv, q_pos, k_pos, Policy.parse("fp32"))
    out = jax.jit(lambda *a: decode_attention(*a, Policy.parse(f"fp32,k={mode}"), chunk=chunk))(
        q, ck, cv, q_pos, k_pos)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(out, ref, atol=1e-6, rtol=0)
    assert float(jnp.abs(ref).max()) > 0.5


@pytest.mark.slow
@pytest.mark.usefixtures("tpu_interpreter")
@pytest.mark.parametrize("shape", [dict(h=8, kh=2, s=300), dict(h=6, kh=2, s=37)])
def test_tpu_version_under_the_tpu_interpreter(shape):
    q, ck, cv, q_pos, k_pos = _case(**shape)
    ref = attention(q, ck, cv, q_pos, k_pos, Policy.parse("fp32"))
    pol = Policy.parse("fp32,k=interpret-tpu")
    out = jax.jit(lambda *a: decode_attention(*a, pol))(q, ck, cv, q_pos, k_pos)
    np.testing.assert_allclose(out, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("mode", MODES)
def test_bf16_kernel_is_within_one_ulp_of_the_reference_and_deterministic(mode):
    q, ck, cv, q_pos, k_pos = _case(s=300, dtype=jnp.bfloat16)
    pol = Policy.parse(f"bf16,k={mode},s=native")  # bf16 arrays, as on a device
    ref = attention(q, ck, cv, q_pos, k_pos, Policy.parse("bf16,s=native"))
    run = jax.jit(lambda *a: decode_attention(*a, pol))
    out = run(q, ck, cv, q_pos, k_pos)
    assert out.dtype == ref.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2, rtol=0)
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(run(q, ck, cv, q_pos, k_pos), np.float32))


@pytest.mark.parametrize("mode", ["auto", *MODES])
def test_the_gradient_is_the_references(mode):
    q, ck, cv, q_pos, k_pos = _case(h=6, kh=2, s=37)
    w = jax.random.normal(jax.random.PRNGKey(5), (3, 1, 6 * 16))  # a linear loss: same cotangent

    def grads(fn):
        loss = lambda q, k, v: jnp.sum(w * fn(q, k, v))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, ck, cv)

    want = grads(lambda q, k, v: attention(q, k, v, q_pos, k_pos, Policy.parse("fp32")))
    pol = Policy.parse(f"fp32,k={mode}")
    got = grads(lambda q, k, v: decode_attention(q, k, v, q_pos, k_pos, pol, chunk=16))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
        assert float(jnp.abs(b).max()) > 0.1


def test_the_policy_picks_the_kernel_in_the_decode_step_only():
    """The traced program holds the kernel under k=interpret, never under k=off; under auto
    the tpu branch holds it (cuda's version is retired, `kernels.dispatch.RETIRED`) and
    lowering for cpu keeps the reference."""
    q, ck, cv, q_pos, k_pos = _case()
    names = lambda pol: pallas_kernels(lambda *a: decode_attention(*a, Policy.parse(pol)), q, ck, cv,
                                       q_pos, k_pos)
    assert names("fp32,k=interpret") == names("fp32,k=interpret-tpu") == ["decode_attention"]
    assert names("fp32,k=off") == []
    assert names("fp32") == ["decode_attention"]
    traced = trace_for(lambda *a: decode_attention(*a, Policy.parse("fp32")), [q, ck, cv, q_pos, k_pos])
    assert "custom_call" not in lower_for(traced, "cpu")


# ---------------------------------------------------------------- lowering at the preset shapes
@pytest.mark.parametrize("case", list(LOWERED))
def test_kernel_lowers_for_tpu_and_refuses_cuda_at_preset_shapes(case):
    """bf16 q, k, v (native low precision) under `on`: one trace lowers for tpu (v5p) with the
    kernel call, and so does its gradient, and refuses cuda (retired); `auto` lowered for cpu
    and cuda calls none."""
    args = _abstract(*LOWERED[case])
    attend = lambda pol: lambda *a: decode_attention(*a, Policy.parse(f"{pol},s=native"))
    traced = trace_for(attend("bf16,k=on"), args, targets=["h100", "tpu-v5p"])
    with pytest.raises(KernelUnavailableError, match="retired"):
        lower_for(traced, "cuda", "h100")
    assert kernel_calls(lower_for(traced, "tpu", "tpu-v5p"), "tpu") == ["decode_attention"]
    on_cpu = lower_for(trace_for(attend("bf16"), args), "cpu")
    assert kernel_calls(on_cpu, "cuda") == kernel_calls(on_cpu, "tpu") == []
    assert kernel_calls(lower_for(trace_for(attend("bf16"), args), "cuda"), "cuda") == []
    # The backward is the reference's VJP: a gradient program lowers on every platform.
    loss = lambda pol: lambda q, k, v, qp, kp: jnp.sum(attend(pol)(q, k, v, qp, kp).astype(jnp.float32))
    grad = lambda pol: jax.grad(loss(pol), argnums=(0, 1, 2))
    assert "custom_call" not in lower_for(trace_for(grad("bf16"), args), "cpu")
    assert kernel_calls(lower_for(trace_for(grad("bf16,k=on"), args), "tpu"), "tpu") == [
        "decode_attention"]


def test_chunking_rule_and_the_plans_of_both_versions():
    assert [chunk_slots(s) for s in (1, 40, 130, 4096, 100_000)] == [16, 16, 32, 512, 512]
    assert pow2_misfit(head_dim=128, chunk=16) is None
    assert "head_dim=96" in pow2_misfit(head_dim=96, chunk=16)
    # cuda: the largest power of two that fits 227 KiB (Mp 16, Dh 128: 144 KiB at 128 slots).
    assert plan_chunk("cuda", 1024, 16, 128, jnp.bfloat16) == (128, None)
    assert plan_chunk("cuda", 100_000, 16, 128, jnp.bfloat16) == (128, None)
    assert plan_chunk("cuda", 40, 16, 16, jnp.float32) == (16, None)
    # tpu: multiples of 128, or the whole cache.
    assert plan_chunk("tpu", 1024, 16, 128, jnp.bfloat16) == (128, None)
    assert plan_chunk("tpu", 4096, 16, 128, jnp.bfloat16) == (512, None)
    assert plan_chunk("tpu", 40, 16, 16, jnp.float32) == (40, None)
    assert "chunk=16 is neither S=300 nor a multiple of 128" in plan_chunk(
        "tpu", 300, 16, 16, jnp.float32, 16)[1]


# ---------------------------------------------------------------- bad input: one clear error each
def test_kernels_on_where_the_platform_has_no_kernel_is_an_error():
    q, ck, cv, q_pos, k_pos = _case()
    with pytest.raises(KernelUnavailableError, match=r"'decode_attention' \(kernels=on\) has no "
                                                     r"version for cpu.*kernels=interpret"):
        decode_attention(q, ck, cv, q_pos, k_pos, Policy.parse("fp32,k=on"))
    traced = trace_for(lambda *a: decode_attention(*a, Policy.parse("fp32,k=on")), [q, ck, cv, q_pos, k_pos])
    with pytest.raises(KernelUnavailableError, match="'decode_attention'.*has no version for cpu"):
        lower_for(traced, "cpu")
    with pytest.raises(KernelUnavailableError, match="no compiled version for cuda: .*retired"):
        lower_for(traced, "cuda")
    assert kernel_calls(lower_for(traced, "tpu"), "tpu") == ["decode_attention"]


def test_head_widths_our_gpu_version_never_took_run_the_reference():
    """Head width 96: under auto the reference runs (here, where it runs: the same values)."""
    q, ck, cv, q_pos, k_pos = _case(dh=96)
    np.testing.assert_array_equal(decode_attention(q, ck, cv, q_pos, k_pos, Policy.parse("fp32")),
                                  attention(q, ck, cv, q_pos, k_pos, Policy.parse("fp32")))


def test_bad_shapes_and_chunks_are_one_clear_error():
    q, ck, cv, q_pos, k_pos = _case()
    with pytest.raises(ValueError, match=r"needs k and v \[B, K, S, Dh\] with K dividing H"):
        decode_attention(q, ck[:, :, :, :8], cv, q_pos, k_pos, Policy.parse("fp32,k=interpret"))
    with pytest.raises(ValueError, match="chunk must be >= 1; got 0"):
        decode_attention(q, ck, cv, q_pos, k_pos, Policy.parse("fp32,k=interpret"), chunk=0)
