"""The fused log-prob's forward on Mosaic GPU (`kernels.logprob_mgpu`): interpreted on CPU against
the reference scan, and lowered for CUDA from this CPU at Qwen3-0.6B's read-out shape.

Tolerances are the log-prob kernels' (tests/test_kernels_logprob.py): log-probs and entropies
within 1e-5 absolute + 1e-6 relative of the reference, whose products are f32 at `HIGHEST` on
the same bf16 operands (the kernel's are `wgmma`'s bf16 products, summed in f32 in its own
order). The logits are kept in f32 here (a bf16 rounding of them could flip on that order).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_lp.kernels import KernelUnavailableError, logprob_mgpu
from jaxrl_lp.kernels.logprob import reference_forward, tiled_readout
from jaxrl_lp.kernels.logprob_tiles import LogprobPlan
from jaxrl_lp.kernels.lowering import lower_for, trace_for
from jaxrl_lp.numerics.policy import Policy

NATIVE = Policy.parse("bf16,s=native")


def _inputs(t, d, v, dtype=jnp.bfloat16, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    h = jax.random.normal(k[0], (t, d)).astype(dtype)
    w = (0.3 * jax.random.normal(k[1], (d, v))).astype(dtype)
    tokens = jax.random.randint(k[2], (t,), 0, v)
    mask = jnp.arange(t) % 4 != 1
    return h, w, tokens, mask


def _plan(impl):
    return LogprobPlan(0.7, np.dtype(np.float32), *logprob_mgpu.MGPU_TILES, impl)


@pytest.mark.parametrize("programs, ranges", [(1, [4]), (3, [2, 2, 0])])
def test_interpreted_forward_equals_the_reference(monkeypatch, programs, ranges):
    """100 rows (padded to 64-row blocks, two of them), 4 vocabulary tiles in one range or
    in three (the last empty), every output within the tolerances of the reference; masked
    rows 0."""
    monkeypatch.setattr(logprob_mgpu, "MIN_PROGRAMS", programs * 2)  # two row blocks
    n_tiles = 512 // logprob_mgpu.MGPU_TILES[1]
    n = logprob_mgpu.splits(128, 512)
    per = -(-n_tiles // n)
    assert [min(per, n_tiles - i * per) for i in range(n)] == ranges
    h, w, tokens, mask = _inputs(100, 128, 512)
    got = logprob_mgpu.mgpu_forward(h, w, tokens, mask, _plan("mosaic"), interpret=True)
    want = reference_forward(h, w, tokens, mask, _plan("reference"))
    for name, a, b in zip(("logp", "entropy", "lse", "mean"), got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-6, err_msg=name)
    assert not np.asarray(got[0])[~np.asarray(mask)].any()
    assert float(want[1][mask].mean()) > 0.5  # entropies far from 0: a real comparison


def test_the_readout_with_the_mosaic_forward_takes_xlas_backward():
    """`tiled_readout(forward="mosaic-interpret")`: values and gradients those of XLA's
    read-out (the same backward, from residuals within the forward's tolerance)."""
    h, w, tokens, mask = _inputs(64, 64, 256)
    g = jax.random.normal(jax.random.PRNGKey(5), (2, 64))

    def grads(forward):
        def loss(h, w):
            lp, ent = tiled_readout(h, w, tokens, mask, 0.7, NATIVE, forward=forward)
            return jnp.sum(g[0] * lp + g[1] * ent), (lp, ent)
        return jax.value_and_grad(loss, (0, 1), has_aux=True)(h, w)

    (_, got), dgot = grads("mosaic-interpret")
    (_, want), dwant = grads("xla")
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-6)
    for a, b in zip(dgot, dwant, strict=True):  # bf16 gradients: a few ulps apart at most
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("d, v, dtype, why", [
    (64, 256, jnp.float32, "bf16 or f16, not float32"),
    (96, 256, jnp.bfloat16, "the hidden size 96 is not a multiple of 64"),
    (64, 1000, jnp.bfloat16, "the vocabulary 1000 is not a multiple of 128"),
])
def test_operands_the_kernel_cannot_take_are_one_clear_error(d, v, dtype, why):
    h, w, tokens, mask = _inputs(8, d, v, dtype)
    with pytest.raises(ValueError, match=re.escape(why)) as err:
        tiled_readout(h, w, tokens, mask, 1.0, NATIVE, forward="mosaic")
    assert "forward='xla' takes any operands" in str(err.value)
    with pytest.raises(ValueError, match="forward is one of"):
        tiled_readout(h, w, tokens, mask, 1.0, NATIVE, forward="triton")


def test_lowers_for_cuda_at_qwen3_0_6b_and_is_refused_elsewhere():
    """Qwen3-0.6B's read-out (4,096 rows, 1,024 x 151,936, bf16): one trace of the loss and
    its gradient lowers for cuda with one Mosaic GPU kernel (the forward; the backward XLA's),
    and lowered for cpu it is one clear error."""
    args = (jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16),
            jax.ShapeDtypeStruct((1024, 151936), jnp.bfloat16),
            jax.ShapeDtypeStruct((4096,), jnp.int32), jax.ShapeDtypeStruct((4096,), jnp.bool_))

    def loss(h, w, tokens, mask):
        lp, ent = tiled_readout(h, w, tokens, mask, 1.0, NATIVE, forward="mosaic")
        return jnp.sum(lp) + jnp.sum(ent)

    traced = trace_for(jax.grad(loss, (0, 1)), args)
    text = lower_for(traced, "cuda")
    assert re.findall(r"custom_call @(\w+)", text) == ["mosaic_gpu_v2"]
    with pytest.raises(KernelUnavailableError, match="compiled for cuda only"):
        lower_for(traced, "cpu")
    assert logprob_mgpu.splits(4096, 151936) == 5  # 64 row blocks x 5 ranges >= 264 programs
