"""The fused vocab-tiled log-prob and entropy (`kernels.logprob`): kernel, reference, integration.

Tolerances (f32, stated in `kernels.logprob`): log-probs and entropies within
1e-5 absolute + 1e-6 relative of `jax.nn.log_softmax` over materialized
logits; gradients (d/dh, d/dW of a weighted sum of both outputs) within 1e-5
absolute + 1e-4 relative of autodiff through it. With bf16 logits rounding the
rounded logits and the rounded cotangent are compared the same way, looser
(3e-5 on values, 2e-3 absolute on gradients: a cotangent one bf16 ulp apart).
The kernels run in Pallas interpret mode (`k=interpret`: the GPU version,
`k=interpret-tpu`: the TPU version), on tiny shapes; `k=off` is the reference
scan. Lowering for `cuda` and `tpu` (what a device compiler gets) is checked
on abstract inputs, with the errors of `kernels=on`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import exactness_grads

from jaxrl_lp.bench.exactness import KINDS, exactness_model, exactness_rollout, masked_max_abs_diff
from jaxrl_lp.kernels.dispatch import KernelUnavailableError
from jaxrl_lp.kernels.logprob import (
    fused_logprobs,
    fused_readout,
    readout_block_v,
    readout_logprobs,
    tiled_readout,
)
from jaxrl_lp.kernels.logprob_gpu import GpuTiles, check_gpu_tiles
from jaxrl_lp.kernels.lowering import kernel_calls, lower_for, trace_for
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.numerics.products import product
from jaxrl_lp.rl.logprobs import learner_logprobs

TAU = 0.7
VALUE_TOL = {"f32": (1e-5, 1e-6), "bf16": (3e-5, 1e-6)}
GRAD_TOL = {"f32": (1e-5, 1e-4), "bf16": (2e-3, 1e-4)}


def _inputs(t, d, v, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    h = jax.random.normal(k[0], (t, d), jnp.float32)
    w = 0.3 * jax.random.normal(k[1], (d, v), jnp.float32)
    tokens = jax.random.randint(k[2], (t,), 0, v)
    mask = (jnp.arange(t) % 4) != 1  # every fourth row masked
    g = jax.random.normal(k[3], (2, t), jnp.float32)
    return h, w, tokens, mask, g


def _plain(h, w, tokens, mask, logits_dtype):
    """The materialized path: logits [T, V], log_softmax, entropy (masked rows 0)."""
    z = (h @ w).astype(logits_dtype).astype(jnp.float32)
    lp = jax.nn.log_softmax(z / TAU, axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    ent = -jnp.sum(jnp.exp(lp) * lp, axis=-1)
    return jnp.where(mask, chosen, 0.0), jnp.where(mask, ent, 0.0)


def _value_and_grads(fn, h, w, g):
    def loss(h, w):
        lp, ent = fn(h, w)
        return jnp.sum(g[0] * lp + g[1] * ent), (lp, ent)

    (_, outs), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(h, w)
    return outs, grads


# (T, D, V, block_v, block_d): odd T; ragged last tile, V below one tile, V a multiple of it.
SHAPES = [(13, 32, 100, 32, 16), (7, 16, 40, 64, 16), (9, 32, 96, 32, 32)]


IMPLS = ("off", "interpret", "interpret-tpu")


@pytest.mark.parametrize("shape,impl,logits", [
    *((s, impl, "f32") for s in SHAPES for impl in IMPLS),
    *((SHAPES[0], impl, "bf16") for impl in IMPLS)])
def test_matches_log_softmax_in_values_and_gradients(shape, impl, logits):
    t, d, v, bv, bd = shape
    h, w, tokens, mask, g = _inputs(t, d, v)
    policy = Policy.parse(f"fp32,l={logits},k={impl}")
    fused = functools.partial(fused_logprobs, tokens_T=tokens, temperature=TAU, policy=policy,
                              mask_T=mask, block_v=bv, block_t=8, block_d=bd)
    (lp, ent), (dh, dw) = _value_and_grads(lambda h, w: fused(h, w), h, w, g)
    (lp0, ent0), (dh0, dw0) = _value_and_grads(
        lambda h, w: _plain(h, w, tokens, mask, policy.logits_dtype), h, w, g)
    atol, rtol = VALUE_TOL[logits]
    np.testing.assert_allclose(lp, lp0, atol=atol, rtol=rtol)
    np.testing.assert_allclose(ent, ent0, atol=atol, rtol=rtol)
    assert float(jnp.abs(lp).max()) > 1.0 and float(ent.min()) >= 0.0
    assert not np.any(np.asarray(lp)[~np.asarray(mask)]), "masked rows give 0"
    atol, rtol = GRAD_TOL[logits]
    np.testing.assert_allclose(dh, dh0, atol=atol, rtol=rtol)
    np.testing.assert_allclose(dw, dw0, atol=atol, rtol=rtol)
    assert not np.any(np.asarray(dh)[~np.asarray(mask)]), "masked rows get no gradient"


def test_kernel_equals_reference_and_keeps_dtypes():
    """Interpret-mode kernel against the tiled reference on the same tiles; bf16 h stays bf16."""
    h, w, tokens, mask, g = _inputs(13, 32, 100, seed=3)
    h = h.astype(jnp.bfloat16)
    outs = {}
    for impl in IMPLS:
        fn = lambda h, w, impl=impl: fused_logprobs(h, w, tokens, TAU, Policy.parse(f"fp32,k={impl}"),
                                                    mask_T=mask, block_v=32, block_t=8)
        outs[impl] = _value_and_grads(fn, h, w, g)
    (lp_r, ent_r), (dh_r, dw_r) = outs["off"]
    for impl in IMPLS[1:]:
        (lp_k, ent_k), (dh_k, dw_k) = outs[impl]
        assert dh_k.dtype == jnp.bfloat16 and dw_k.dtype == jnp.float32, impl
        np.testing.assert_allclose(lp_k, lp_r, atol=1e-5, rtol=1e-6)
        np.testing.assert_allclose(ent_k, ent_r, atol=1e-5, rtol=1e-6)
        np.testing.assert_allclose(dh_k.astype(jnp.float32), dh_r.astype(jnp.float32), atol=2e-2)
        np.testing.assert_allclose(dw_k, dw_r, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- lowering for cuda and tpu
def _abstract(t, d, v, dtype):
    s = jax.ShapeDtypeStruct
    return s((t, d), dtype), s((d, v), dtype), s((t,), jnp.int32)


def _loss(policy, **tiles):
    def f(h, w, tokens):
        lp, ent = fused_logprobs(h, w, tokens, 1.0, Policy.parse(policy), **tiles)
        return jnp.sum(lp) + jnp.sum(ent)
    return jax.grad(f, (0, 1))


def test_one_traced_program_carries_each_platforms_kernels():
    """`auto`: the reference on cpu and on cuda (our GPU versions are retired,
    `kernels.dispatch.RETIRED`), the Mosaic kernels on tpu (forward and both backward kernels),
    from one trace at Qwen3-0.6B's read-out shape."""
    traced = trace_for(_loss("fp32"), _abstract(4096, 1024, 151936, jnp.bfloat16))
    assert kernel_calls(lower_for(traced, "cpu"), "cuda") == []
    assert "pallas" not in lower_for(traced, "cpu")
    assert kernel_calls(lower_for(traced, "cuda"), "cuda") == []
    assert sorted(kernel_calls(lower_for(traced, "tpu", "tpu-v5p"), "tpu")) == [
        "logprob_dh_tpu", "logprob_dw_tpu", "logprob_fwd_tpu"]


def test_the_readout_holds_no_vocabulary_wide_array_off_the_cpu():
    """`readout_logprobs` where no kernel runs: the caller's plain path on cpu (a `[T, V]`
    array), the tiled scan on cuda (no `[T, V]` array, forward or backward), at Qwen3-0.6B's
    read-out shape; and the same scan on this CPU within the tolerances of the plain path, its
    tiles `readout_block_v` wide."""
    t, d, v = 4096, 1024, 151936

    def loss(h, w, tokens):
        z = lambda: (h @ w).astype(jnp.float32)
        plain = lambda: (jnp.take_along_axis(jax.nn.log_softmax(z()), tokens[:, None], 1)[:, 0],
                         jnp.zeros(tokens.shape))
        lp, ent = readout_logprobs(h, w, tokens, 1.0, Policy.parse("bf16"), plain=plain)
        return jnp.sum(lp) + jnp.sum(ent)

    traced = trace_for(jax.grad(loss, (0, 1)), _abstract(t, d, v, jnp.bfloat16))
    # A product writing [T, V] logits (under grad the cond of the platforms also carries the
    # plain branch's residual as zeros, which the compiler drops with the branch).
    wide = lambda text: [line for line in text.splitlines()
                         if "dot_general" in line and f"-> tensor<{t}x{v}x" in line]
    assert wide(lower_for(traced, "cpu"))
    assert not wide(lower_for(traced, "cuda"))
    assert f"{t}x{v}x" not in lower_for(trace_for(loss, _abstract(t, d, v, jnp.bfloat16)), "cuda")
    assert readout_block_v(t, v) == 32768 and readout_block_v(12288, v) == 8192
    assert readout_block_v(13, 100) == 100 and readout_block_v(13, 1100) == 1024

    h, w, tokens, mask, g = _inputs(13, 32, 1100)  # a full tile of 1024 and a ragged one
    for spec, tol in (("fp32", "f32"), ("bf16", "bf16")):
        policy = Policy.parse(spec)
        hc, wc = policy.round(h), policy.round_params(w)

        def plain(h, w, policy=policy):  # the model's path: `models.layers.dot`'s product
            z = policy.round_logits(product("td,dv->tv", h, w, policy))
            lp = jax.nn.log_softmax(z / TAU, axis=-1)
            chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
            ent = -jnp.sum(jnp.exp(lp) * lp, axis=-1)
            return jnp.where(mask, chosen, 0.0), jnp.where(mask, ent, 0.0)

        (lp, ent), (dh, dw) = _value_and_grads(
            lambda h, w, policy=policy: tiled_readout(h, w, tokens, mask, TAU, policy), hc, wc, g)
        (lp0, ent0), (dh0, dw0) = _value_and_grads(plain, hc, wc, g)
        for got, want, (atol, rtol) in ((lp, lp0, VALUE_TOL[tol]), (ent, ent0, VALUE_TOL[tol]),
                                        (dh, dh0, GRAD_TOL[tol]), (dw, dw0, GRAD_TOL[tol])):
            np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=spec)
        assert float(jnp.abs(lp).max()) > 1.0 and not np.any(np.asarray(dh)[~np.asarray(mask)])


# ---------------------------------------------------------------- bad input: one clear error each
def test_kernels_on_where_the_platform_has_no_kernel_is_an_error():
    h, w, tokens, _, _ = _inputs(4, 16, 40)
    # Eagerly on this CPU, and when a program holding it is lowered for cpu ...
    with pytest.raises(KernelUnavailableError, match="'logprob' .*has no version for cpu"):
        fused_logprobs(h, w, tokens, 1.0, Policy.parse("fp32,k=on"))
    traced = trace_for(_loss("fp32,k=on"), _abstract(64, 128, 1024, jnp.float32))
    with pytest.raises(KernelUnavailableError, match="has no version for cpu"):
        lower_for(traced, "cpu")
    # ... and for cuda, whose version is retired, while the same trace lowers for tpu.
    with pytest.raises(KernelUnavailableError, match="no compiled version for cuda: .*retired"):
        lower_for(traced, "cuda")
    assert len(kernel_calls(lower_for(traced, "tpu"), "tpu")) == 3
    readout = lambda spec: fused_readout(Policy.parse(spec))
    assert readout("bf16,k=on") and readout("fp32") and readout("fp32,k=interpret")
    assert not readout("fp32,k=off")
    assert not readout("fp32,k=interpret,mm=mxfp8")  # the lm head's quantized matmul


def test_tiles_that_do_not_fit_are_one_clear_error():
    h, w, tokens, _, _ = _inputs(4, 32, 100)
    call = lambda **kw: fused_logprobs(h, w, tokens, 1.0, Policy.parse("fp32,k=interpret"), **kw)
    with pytest.raises(ValueError, match="block_d=24 does not divide the reduction axis D=32"):
        call(block_d=24)
    with pytest.raises(ValueError, match="block_v must be a positive int; got 0"):
        call(block_v=0)
    with pytest.raises(ValueError, match="block_t must be a positive int"):
        call(block_t=2.5)
    with pytest.raises(ValueError, match="quantizes matmuls"):
        fused_logprobs(h, w, tokens, 1.0, Policy.parse("fp32,mm=mxfp8,k=interpret"))
    # What a compiled (GPU) kernel needs on top: lane-wide, power-of-two tiles.
    assert "block_v=192 is not a power of two" in check_gpu_tiles(1024, 151936, GpuTiles(16, 192, 64))
    assert "multiple of the 128-wide lane" in check_gpu_tiles(1024, 151936, GpuTiles(16, 64, 64))
    assert "= 384) is not a power of two" in check_gpu_tiles(1024, 151936, GpuTiles(16, 512, 64))
    assert check_gpu_tiles(1024, 151936, GpuTiles(16, 256, 64)) is None  # Qwen3's vocab: fits


def test_a_tpu_tile_over_the_vmem_is_an_error_under_on():
    """512 x 1024 tiles at D 2560 in f32 need far more than v5p's 16 MiB of scoped VMEM: under
    `on` lowering for tpu names the kernel, the tile, the need and the limit (cuda: the
    retirement); under `auto` the tpu branch runs the reference."""
    from jaxrl_lp.kernels.logprob_tpu import TpuLogprobTiles, TpuTiles

    big = TpuLogprobTiles(*[TpuTiles(512, 1024)] * 3)
    args = _abstract(1024, 2560, 151936, jnp.float32)
    traced = trace_for(_loss("fp32,k=on", tpu_tiles=big), args, targets=["tpu-v5p"])
    with pytest.raises(KernelUnavailableError,
                       match=r"'logprob' \(kernels=on\) does not fit tpu: the tile forward 512 x "
                             r"1024 at D=2560 needs .* MiB of VMEM .*over tpu-v5p's limit of "
                             r"16.0 MiB"):
        lower_for(traced, "tpu", "tpu-v5p")
    with pytest.raises(KernelUnavailableError, match="retired"):
        lower_for(traced, "cuda")
    auto = lower_for(trace_for(_loss("fp32", tpu_tiles=big), args, targets=["tpu-v5p"]), "tpu")
    assert kernel_calls(auto, "tpu") == []


# ---------------------------------------------------------------- memory: no [tokens, vocab] in f32
def test_grpo_like_loss_peak_memory_drops_by_more_than_the_f32_logits():
    """value_and_grad of a PPO-style loss over 4096 tokens, vocab 151936, hidden 1024 (compiled only)."""
    t, d, v = 4096, 1024, 151936

    def loss(lp, ent, adv):
        ratio = jnp.exp(lp - jax.lax.stop_gradient(lp))
        return -jnp.mean(ratio * adv) - 1e-3 * jnp.mean(ent)

    def plain(h, w, tokens, adv):  # the dense path before: logits, log_softmax twice
        logits = jnp.einsum("td,dv->tv", h, w, preferred_element_type=jnp.float32)
        lp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[:, None], 1)[:, 0]
        lp2 = jax.nn.log_softmax(logits, -1)
        return loss(lp, -jnp.sum(jnp.exp(lp2) * lp2, -1), adv)

    def fused(policy):
        return lambda h, w, tokens, adv: loss(*fused_logprobs(h, w, tokens, 1.0,
                                                              Policy.parse(policy)), adv)

    args = (jax.ShapeDtypeStruct((t, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
            jax.ShapeDtypeStruct((t,), jnp.int32), jax.ShapeDtypeStruct((t,), jnp.float32))
    temp = {}
    for name, fn in (("plain", plain), ("reference", fused("fp32,k=off")),
                     ("interpret", fused("fp32,k=interpret"))):
        compiled = jax.jit(jax.value_and_grad(fn, (0, 1))).lower(*args).compile()
        temp[name] = compiled.memory_analysis().temp_size_in_bytes
    print({k: f"{b / 2**20:.0f} MiB" for k, b in temp.items()})
    for name in ("reference", "interpret"):
        assert temp["plain"] - temp[name] >= t * v * 4, temp


# ---------------------------------------------------------------- exactness cells with kernels on
PROMPTS = ((1, 5, 7), (2, 9, 4, 11, 3, 8), (6,))


@functools.cache
def _cell(pol, kind):
    """(cfg, params, policy, loop, rollout) sampled with the fused log-prob (interpret mode)."""
    cfg, params, loop = exactness_model(kind, loop_steps=4)
    policy = Policy.parse(pol if "k=" in pol else f"{pol},k=interpret")
    ro = exactness_rollout(params, cfg, policy, loop, prompts=PROMPTS, num_samples=2,
                           max_new_tokens=8)
    return cfg, params, policy, loop, ro


@pytest.mark.parametrize("pol,kind", [
    ("fp32", "dense"),  # the TPU kernel's cell (20 s cold on 2 cores) in the slow tier:
    pytest.param("fp32,k=interpret-tpu", "dense", marks=pytest.mark.slow),
    pytest.param("fp32", "looped_deferred", marks=pytest.mark.slow),
    *(pytest.param(p, k, marks=pytest.mark.slow)
      for p in ("fp32", "bf16") for k in KINDS
      if (p, k) not in (("fp32", "dense"), ("fp32", "looped_deferred")))])
def test_replay_and_hybrid_stay_exact_with_the_kernel_on(pol, kind):
    """Replay == sampler bit for bit; hybrid's value is the sampler's, its gradient dense's."""
    cfg, params, policy, loop, ro = _cell(pol, kind)
    assert "pallas_call" in str(jax.make_jaxpr(
        lambda p: learner_logprobs(p, cfg, policy, ro, "hybrid", loop=loop))(params))
    (g_hybrid, hybrid), (g_dense, dense), replay = jax.jit(exactness_grads(cfg, policy, ro, loop))(
        params)
    mask = ro.completion_mask
    assert masked_max_abs_diff(replay, ro.logprobs, mask) == 0.0
    assert masked_max_abs_diff(hybrid, ro.logprobs, mask) == 0.0
    # Dense is one parallel forward: close to the sampler and not equal to it (so the hybrid's
    # value, equal to it, is not dense's). Measured on XLA:CPU over the seven cells: max
    # |dlogp| 9.5e-7 in f32 (13-18 of 45-46 tokens differ), 1.0e-2 in bf16 (40-42 differ);
    # the tolerances are about 4x those.
    assert 0.0 < masked_max_abs_diff(dense, ro.logprobs, mask) < {"fp32": 4e-6,
                                                                  "bf16": 4e-2}[pol[:4]]
    for a, b in zip(jax.tree.leaves(g_hybrid), jax.tree.leaves(g_dense), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert max(float(jnp.abs(a).max()) for a in jax.tree.leaves(g_hybrid)) > 0.0


@pytest.mark.slow  # the slow tier (17 s cold): the GRPO step's read-out through the kernel is default
def test_sft_step_reads_the_hidden_state_through_the_kernel():
    """A dense model's SFT loss and gradient by the fused path match the plain path's."""
    from jaxrl_lp.models.config import get_preset
    from jaxrl_lp.models.model import init_params
    from jaxrl_lp.rl import make_sft_step

    cfg = get_preset("tiny-qwen3").replace(num_layers=1, vocab_size=100)  # V: a ragged tile
    params = init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, cfg.vocab_size)
    mask = jnp.ones(tokens.shape).at[1, 6:].set(0.0)
    out = {}
    for pol in ("fp32", "fp32,k=interpret"):
        step = make_sft_step(cfg, Policy.parse(pol), optax.sgd(1.0))
        new, _, m = step(jax.tree.map(jnp.copy, params), optax.sgd(1.0).init(params), tokens, mask)
        out[pol] = (float(m["loss"]), jax.tree.map(lambda a, b: a - b, new, params))
    np.testing.assert_allclose(out["fp32,k=interpret"][0], out["fp32"][0], rtol=1e-6)
    for a, b in zip(*(jax.tree.leaves(o[1]) for o in out.values()), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
