"""The Mosaic TPU log-prob kernels (`kernels.logprob_tpu`) against the jnp reference of `kernels.logprob`.

Interpret mode on CPU: `interpret=True`, Pallas's generic interpreter (it
keeps VMEM scratch across grid steps and pads a block that overruns its array
with NaN, so the masking of columns past V is exercised), and for one case
`pltpu.InterpretParams()`, the TPU interpreter (NaN in VMEM buffers a block's
DMA leaves unwritten, as a real chip leaves stale data). Tolerances, as
tests/test_kernels_logprob.py states them, against `reference_forward` /
`reference_backward` on the same inputs, in f32: values within 1e-5 absolute +
1e-6 relative, gradients within 1e-5 absolute + 1e-4 relative; with bf16 logits
rounding 3e-5 on values and 2e-3 absolute on gradients (a cotangent one bf16
ulp apart).

bf16 h and W: both sides take the same bf16 arrays and accumulate in f32 (the
kernels upcast the bf16 operand of a mixed dot, as the reference's einsum
promotes), so the f32 values keep the f32 tolerance. dh and dW are rounded
once to bf16 from f32 sums taken in another order (dW: over row blocks of 8,
the reference over all rows at once), so an entry may land one bf16 ulp away:
at most 2^-7 of its value (rtol 2^-7; atol 1e-6 for zeros).

Measured on this CPU: f32 differences <= 9.6e-7 (a few f32 ulps) in every
case; with bf16 inputs dh is bit-equal and 4 of 9600 dW entries are one bf16
ulp apart (3.8e-6 absolute, 5.3e-3 relative). The lowering tests lower each
kernel for TPU at the preset shapes on abstract inputs: what JAX checks
(Mosaic's block rules), not the chip's compiler.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxrl_lp.kernels.logprob import LogprobPlan, reference_backward, reference_forward
from jaxrl_lp.kernels.logprob_tpu import (
    KERNELS,
    TpuLogprobTiles,
    TpuTiles,
    check_tpu_tiles,
    tpu_backward,
    tpu_forward,
    tpu_tiles,
    vmem_bytes,
)
from jaxrl_lp.kernels.lowering import kernel_calls, lower_for

TAU = 0.7
MIB = 1 << 20
VALUE_TOL = {"f32": (1e-5, 1e-6), "bf16": (3e-5, 1e-6)}
GRAD_TOL = {"f32": (1e-5, 1e-4), "bf16": (2e-3, 1e-4)}
SMALL = TpuLogprobTiles(TpuTiles(8, 128), TpuTiles(8, 128), TpuTiles(8, 128))
MIXED = TpuLogprobTiles(TpuTiles(16, 256), TpuTiles(8, 128), TpuTiles(16, 128))
# Qwen3-0.6B, Qwen3-4B, Ouro-1.4B: (D, V) of the lm head, at T = 4096 rows.
PRESETS = {"qwen3-0.6b": (1024, 151936), "qwen3-4b": (2560, 151936), "ouro-1.4b": (2048, 49152)}
T_PRESET = 4096


def _plan(logits_dtype=np.float32, d=32):
    return LogprobPlan(TAU, np.dtype(logits_dtype), 16, 128, d, "reference")


def _inputs(t, d, v, dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    h = jax.random.normal(k[0], (t, d), jnp.float32).astype(dtype)
    w = (0.3 * jax.random.normal(k[1], (d, v), jnp.float32)).astype(dtype)
    tokens = jax.random.randint(k[2], (t,), 0, v)
    mask = (jnp.arange(t) % 4) != 1  # every fourth row masked
    g_lp, g_ent = (jnp.where(mask, g, 0.0) for g in jax.random.normal(k[3], (2, t), jnp.float32))
    return h, w, tokens, mask, g_lp, g_ent


@functools.partial(jax.jit, static_argnames=("plan", "tiles", "interpret"))
def _kernel(h, w, tokens, mask, g_lp, g_ent, plan, tiles, interpret=True):
    lp, ent, lse, mean = tpu_forward(h, w, tokens, mask, plan, tiles, interpret)
    return (lp, ent, lse, mean), tpu_backward(h, w, tokens, lse, mean, g_lp, g_ent, plan, tiles,
                                              interpret)


@functools.partial(jax.jit, static_argnames=("plan",))
def _reference(h, w, tokens, mask, g_lp, g_ent, plan):
    lp, ent, lse, mean = reference_forward(h, w, tokens, mask, plan)
    return (lp, ent, lse, mean), reference_backward(h, w, tokens, lse, mean, g_lp, g_ent, plan)


def _close(got, want, atol, rtol, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=what)
    return float(np.abs(got - want).max())


# (T, D, V): (a) T not a multiple of block_t; (b) several vocab tiles and a ragged last one;
# (c) V below one tile (one ragged tile). Every case masks every fourth row (d).
CASES = {"ragged_rows": (13, 32, 256), "ragged_vocab": (16, 32, 300), "vocab_below_tile": (11, 16, 40)}


@pytest.mark.parametrize("case,tiles,logits,interpret", [
    *((c, SMALL, "f32", True) for c in CASES), ("ragged_vocab", MIXED, "f32", True),
    ("ragged_vocab", SMALL, "bf16", True),
    # The TPU interpreter: blocks are DMA'd into VMEM buffers whose unwritten part is NaN.
    ("ragged_vocab", MIXED, "f32", pltpu.InterpretParams())])
def test_kernels_match_the_reference(case, tiles, logits, interpret):
    t, d, v = CASES[case]
    args = _inputs(t, d, v)
    plan = _plan(jnp.bfloat16 if logits == "bf16" else np.float32, d)
    fwd, (dh, dw) = _kernel(*args, plan=plan, tiles=tiles, interpret=interpret)
    fwd0, (dh0, dw0) = _reference(*args, plan=plan)
    atol, rtol = VALUE_TOL[logits]
    for name, x, x0 in zip(("logp", "entropy", "lse", "mean"), fwd, fwd0, strict=True):
        assert x.shape == (t,) and x.dtype == jnp.float32
        _close(x, x0, atol, rtol, name)
    atol, rtol = GRAD_TOL[logits]
    assert dh.shape == (t, d) and dw.shape == (d, v) and dh.dtype == dw.dtype == jnp.float32
    _close(dh, dh0, atol, rtol, "dh")
    _close(dw, dw0, atol, rtol, "dW")
    assert np.all(np.isfinite(np.asarray(dw))), "columns past V must not leak NaN"
    # (d) masked rows give 0 log-prob and entropy, and (zero g's) no gradient.
    masked = ~np.asarray(args[3])
    assert not np.any(np.asarray(fwd[0])[masked]) and not np.any(np.asarray(fwd[1])[masked])
    assert not np.any(np.asarray(dh)[masked])
    assert float(jnp.abs(fwd[0]).max()) > 1.0 and float(fwd[1].min()) >= 0.0


def test_bf16_inputs_match_the_reference_fed_the_same_arrays():
    """(f) bf16 h and W: dh, dW come back in bf16, within one bf16 ulp of the reference's."""
    t, d, v = CASES["ragged_vocab"]
    args = _inputs(t, d, v, dtype=jnp.bfloat16, seed=1)
    plan = _plan(np.float32, d)
    fwd, (dh, dw) = _kernel(*args, plan=plan, tiles=SMALL)
    fwd0, (dh0, dw0) = _reference(*args, plan=plan)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    for name, x, x0 in zip(("logp", "entropy", "lse", "mean"), fwd, fwd0, strict=True):
        _close(x, x0, *VALUE_TOL["f32"], name)
    _close(dh, dh0, 1e-6, 2.0 ** -7, "dh")  # one bf16 ulp (module docstring)
    _close(dw, dw0, 1e-6, 2.0 ** -7, "dW")


# ---------------------------------------------------------------- tiles and VMEM
def test_tile_rules_name_the_bad_tile():
    with pytest.raises(ValueError, match="'dh'.*block_t=12 is not a positive multiple of 8"):
        check_tpu_tiles(TpuTiles(12, 128), "dh")
    with pytest.raises(ValueError, match="'forward'.*block_v=200 is not a positive multiple of 128"):
        check_tpu_tiles(TpuTiles(8, 200), "forward")
    check_tpu_tiles(TpuTiles(8, 128), "dw")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("preset", PRESETS)
def test_default_plans_fit_16_mib_at_the_presets(preset, dtype):
    d, v = PRESETS[preset]
    plan = tpu_tiles(T_PRESET, d, v, dtype, dtype, 16 * MIB)
    assert isinstance(plan, TpuLogprobTiles), plan
    for kernel, tiles in zip(KERNELS, plan, strict=True):
        check_tpu_tiles(tiles, kernel)
        assert vmem_bytes(kernel, tiles, d, dtype, dtype) <= 16 * MIB
        assert tiles.block_t >= 128, (kernel, tiles)  # big enough to keep the MXU busy


def test_plans_respect_small_shapes_and_refuse_a_limit_too_small():
    plan = tpu_tiles(13, 32, 40, jnp.float32, jnp.float32, 16 * MIB)
    assert all(p.block_t <= 16 and p.block_v == 128 for p in plan), plan
    why = tpu_tiles(T_PRESET, 2560, 151936, jnp.float32, jnp.float32, MIB)
    assert isinstance(why, str) and "8 x 128" in why and "D=2560" in why
    # A compiled kernel checks its tile against the target's VMEM while it is traced.
    h, w = jax.ShapeDtypeStruct((512, 2560), jnp.float32), jax.ShapeDtypeStruct((2560, 4096), jnp.float32)
    rows = jax.ShapeDtypeStruct((512,), jnp.int32)
    big = TpuLogprobTiles(*[TpuTiles(512, 1024)] * 3)
    with pytest.raises(ValueError, match="over tpu-v5.*limit of 16.0 MiB"):
        jax.eval_shape(lambda h, w, r: tpu_forward(h, w, r, r, _plan(), big, False), h, w, rows)


# ---------------------------------------------------------------- lowering for TPU
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("preset", PRESETS)
def test_each_kernel_lowers_for_tpu_at_the_presets(preset, dtype):
    d, v = PRESETS[preset]
    tiles = tpu_tiles(T_PRESET, d, v, dtype, dtype, 16 * MIB)
    plan = LogprobPlan(TAU, np.dtype(np.float32), 16, 128, d, "kernel")
    sds = jax.ShapeDtypeStruct
    h, w = sds((T_PRESET, d), dtype), sds((d, v), dtype)
    tok, f32 = sds((T_PRESET,), jnp.int32), sds((T_PRESET,), jnp.float32)
    fwd = lambda h, w, tok, mask: tpu_forward(h, w, tok, mask, plan, tiles, False)
    bwd = lambda h, w, tok, *r: tpu_backward(h, w, tok, *r, plan, tiles, False)
    text = lower_for((fwd, (h, w, tok, sds((T_PRESET,), jnp.bool_))), "tpu", "tpu-v5p")
    assert kernel_calls(text, "tpu") == ["logprob_fwd_tpu"]
    text = lower_for((bwd, (h, w, tok, f32, f32, f32, f32)), "tpu", "tpu-v5p")
    assert kernel_calls(text, "tpu") == ["logprob_dh_tpu", "logprob_dw_tpu"]
