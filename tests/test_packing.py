"""The padding-free learner (`models.packing`): packed rows give the unpacked values and gradients.

One batch of ragged rollouts of the tiny dense model (prompts of 1-6 tokens
left-padded to 8, completions ending at EOS or at 12 tokens); the packed
dense log-probs against the plain ones, in the plain read-out and through
the fused log-prob kernel (interpret mode), and one GRPO step each way.
Tolerances: the two compute the same sums with matmuls of other row
counts, which XLA:CPU may round differently (`pytest -s` prints the
differences: about 5e-7 in values and 6e-7 relative in gradients here).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_lp.bench.exactness import exactness_model, exactness_rollout
from jaxrl_lp.models.packing import bucket_rows, gather_rows, make_packing, pack, unpack
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rl import LossConfig, make_grpo_step
from jaxrl_lp.rl.logprobs import dense_logprobs, packed_rows_of


@functools.cache
def _sampled():
    cfg, params, loop = exactness_model("dense")
    return cfg, params, exactness_rollout(params, cfg, "fp32", loop)


def batch(pol):
    """The f32 rollout, read under `pol` (dense_logprobs does not check the sampler's policy)."""
    cfg, params, ro = _sampled()
    return cfg, params, Policy.parse(pol), ro


def assert_same_update(plain, packed):
    """Two (params, opt_state, metrics) of one SGD(0.1) step: equal up to matmul rounding."""
    (p0, _, m0), (p1, _, m1) = plain, packed
    assert float(m1["skipped"]) == 0.0
    np.testing.assert_allclose(m1["loss"], m0["loss"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(m1["grad_norm"], m0["grad_norm"], rtol=1e-5)
    for a, c in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True):
        np.testing.assert_allclose(c, a, atol=1e-6)


def test_gather_rows_gradient_is_the_transpose_without_a_scatter():
    x = jax.random.normal(jax.random.PRNGKey(0), (6, 3))
    index = jnp.array([4, 0, 6, 2], jnp.int32)  # 6: a zero row
    inverse = jnp.array([1, 4, 3, 4, 0, 4], jnp.int32)  # 4 (= M): not taken
    y, vjp = jax.vjp(lambda a: gather_rows(a, index, inverse), x)
    y_ref, vjp_ref = jax.vjp(lambda a: jnp.take(a, index, axis=0, mode="fill", fill_value=0), x)
    g = jax.random.normal(jax.random.PRNGKey(1), y.shape)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(vjp(g)[0], vjp_ref(g)[0])
    assert "scatter" not in jax.jit(jax.grad(lambda a: jnp.sum(gather_rows(a, index, inverse) * g))
                                    ).lower(x).as_text()


def test_packing_puts_real_slots_first_and_round_trips():
    real = jnp.array([[0, 1, 1, 0], [1, 1, 0, 0]], bool)
    packing, fits = make_packing(real, 6)
    np.testing.assert_array_equal(packing.index_M, [1, 2, 4, 5, 0, 3])  # real, then padding
    assert bool(fits) and not bool(make_packing(real, 3)[1])
    x = jnp.arange(8.0).reshape(2, 4)
    back = unpack(pack(x, packing), packing, 2, 4)
    np.testing.assert_array_equal(back, jnp.where(jnp.arange(8).reshape(2, 4) < 6, x, 0.0))
    with pytest.raises(ValueError, match=r"rows=9 must be in \[1, 8\]"):
        make_packing(real, 9)


def test_bucket_rows():
    assert bucket_rows(786, 1024, 16) == 832
    assert bucket_rows(658, 896, 16) == 672
    assert bucket_rows(1024, 1024, 16) == 1024 and bucket_rows(0, 1024, 16) == 64
    assert len({bucket_rows(c, 1000, 16) for c in range(1001)}) == 16
    with pytest.raises(ValueError, match="count 9 is not in"):
        bucket_rows(9, 8, 4)


@pytest.mark.parametrize("pol", ["fp32", "fp32,k=interpret"])
def test_packed_dense_logprobs_equal_the_unpacked_ones(pol):
    """Values and gradients of a masked loss of log-probs and entropies; NaN when rows are short."""
    cfg, params, policy, ro = batch(pol)
    # A hole in one row's mask: the token stays context for the ones after it.
    assert float(ro.completion_mask[1, 4]) == 1.0
    ro = dataclasses.replace(ro, completion_mask=ro.completion_mask.at[1, 3].set(0.0))
    rows = packed_rows_of(ro)
    b, p = ro.prompt_tokens.shape
    n = ro.completion_tokens.shape[1]
    assert rows[0] < b * (p + n) and rows[1] < b * n  # the padding is really skipped
    weight = ro.completion_mask * jnp.arange(1.0, n + 1)

    @functools.partial(jax.jit, static_argnums=1)
    def run(params, rows):
        def loss(p):
            lp, ent = dense_logprobs(p, cfg, policy, ro, packed_rows=rows)
            return jnp.sum((lp + 0.3 * ent) * weight), (lp, ent)
        return jax.value_and_grad(loss, has_aux=True)(params)

    (_, (lp0, ent0)), g0 = run(params, None)
    (_, (lp1, ent1)), g1 = run(params, rows)
    mask = ro.completion_mask > 0
    for plain, packed in ((lp0, lp1), (ent0, ent1)):
        np.testing.assert_allclose(np.where(mask, packed, 0.0), np.where(mask, plain, 0.0),
                                   atol=1e-5)
        assert np.all(np.asarray(packed)[~np.asarray(mask)] == 0.0)
    for a, c in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(c, a, atol=1e-5 * float(jnp.max(jnp.abs(a))) + 1e-12)
    grad_rel = max(float(jnp.max(jnp.abs(c - a)) / (jnp.max(jnp.abs(a)) + 1e-12))
                   for a, c in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True))
    print(f"{pol}: packed - plain, max |dlogp| {float(jnp.max(jnp.where(mask, abs(lp1 - lp0), 0))):.2g}"
          f", max relative gradient difference {grad_rel:.2g}")
    if pol == "fp32":  # one more compilation; the check does not depend on the read-out
        (_, (short, _)), _ = run(params, (rows[0] - 8, rows[1]))
        assert bool(jnp.all(jnp.isnan(short)))


def test_packed_grpo_step_equals_the_unpacked_step():
    cfg, params, policy, ro = batch("fp32")
    opt = optax.sgd(0.1)
    adv = jnp.linspace(-1.0, 1.0, ro.logprobs.shape[0])
    out = {}
    # Packed: two micro-batches (each packed to the larger one's bucket), recomputed layers.
    for buckets, mbs in ((0, 1), (16, 2)):
        step = make_grpo_step(cfg, policy, LossConfig(), opt, method="dense",
                              pack_buckets=buckets, micro_batches=mbs, remat=buckets > 0)
        if buckets:  # the layers run on the packed rows of a micro-batch
            body, _ = packed_rows_of(ro, micro_batches=2)
            assert body < ro.logprobs.shape[0] // 2 * (ro.prompt_tokens.shape[1] + ro.logprobs.shape[1])
            text = step.lower(params, opt.init(params), ro, adv, ro.logprobs).as_text()
            assert f"tensor<1x{body}x{cfg.hidden_size}xf32>" in text
        out[buckets] = step(jax.tree.map(jnp.copy, params), opt.init(params), ro, adv,
                            ro.logprobs)
    assert_same_update(out[0], out[16])


def test_packing_refuses_looped_models_and_caches():
    from jaxrl_lp.models.model import forward

    looped_cfg, looped_params, _ = exactness_model("looped_dense")
    dcfg, dparams, _, ro = batch("fp32")
    with pytest.raises(ValueError, match="packed dense forward is built for dense models"):
        dense_logprobs(looped_params, looped_cfg, Policy.parse("fp32"), ro, packed_rows=(8, 8))
    packing, _ = make_packing(jnp.ones((1, 4), bool), 4)
    from jaxrl_lp.models.cache import init_cache
    with pytest.raises(ValueError, match="packed forward has no KV cache"):
        forward(dparams, dcfg, "fp32", jnp.ones((1, 4), jnp.int32),
                cache=init_cache(dcfg, Policy.parse("fp32"), 1, 4), packing=packing)


def test_packed_sft_step_equals_the_unpacked_step():
    """The SFT step skips the tokens after each row's last target (the fused read-out of the
    same packed rows is checked above)."""
    from jaxrl_lp.data.pipeline import sft_batch
    from jaxrl_lp.rl import make_sft_step
    from jaxrl_lp.rl.logprobs import packed_rows_for

    cfg, params, policy, _ = batch("fp32")
    rs = np.random.RandomState(0)
    examples = [(list(rs.randint(3, 50, p)), list(rs.randint(3, 50, c)))
                for p, c in ((1, 4), (5, 9), (3, 2), (2, 13))]
    b = sft_batch(examples, pad_id=0, seq_len=20)
    rows = packed_rows_for(np.ones(4), b.loss_mask_BxL[:, 1:], 1)
    assert rows[0] < 4 * 20 and rows[1] < 4 * 19
    opt = optax.sgd(0.1)
    out = {}
    for buckets in (0, 16):
        step = make_sft_step(cfg, policy, opt, pack_buckets=buckets)
        out[buckets] = step(jax.tree.map(jnp.copy, params), opt.init(params),
                            jnp.asarray(b.tokens_BxL), jnp.asarray(b.loss_mask_BxL))
    assert_same_update(out[0], out[16])
