"""The sampler's token draw (`SamplingConfig.draw`, `grpo.draw`).

- The default draw is `jax.random.categorical`'s, token for token (the default
  run is unchanged), and `first_argmax` is `jnp.argmax`'s index for every
  input (ties, NaN, -inf rows, signed zeros, booleans).
- `inverse_cdf` samples the filtered, tempered distribution: with a fixed
  seed, a chi-square test of 40000 draws against the exact probabilities
  (computed here in numpy, independently of `rollout.sampling`) has p-value
  >= 1e-3 under temperature, top-k and top-p; no filtered token is ever drawn,
  over a 32000-token vocabulary too. The same test rejects (p < 1e-3) the
  distribution without the temperature and filters, so it has the power to
  see a wrong draw.
- A rollout drawn by `inverse_cdf` is replayed bit for bit (the replay scores
  the tokens; it does not draw), and its tokens are not the Gumbel draw's.
- Bad values are refused by name; `grpo.speculative` needs the Gumbel draw.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxrl_lp.bench.exactness import exactness_model, masked_max_abs_diff
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rl.logprobs import replay_logprobs
from jaxrl_lp.rollout import SamplingConfig, generate, sample_tokens
from jaxrl_lp.rollout.noise import gumbel, threefry_bits
from jaxrl_lp.rollout.sampling import _filter, first_argmax, gumbel_max
from jaxrl_lp.train.config import GRPOConfig

P_MIN = 1e-3  # the chi-square p-value a correct draw must reach (seeds fixed: deterministic)
DRAWS = 40_000
LOGITS = np.array([2.0, 1.5, 1.4, 0.3, 0.0, -0.2, -0.5, -1.0, -1.1, -2.0, -3.0, -4.0],
                  np.float32)


def _exact(logits, cfg: SamplingConfig) -> np.ndarray:
    """softmax of the tempered logits over the top-k, then top-p set (of the top-k's
    renormalized distribution, as the sampler filters), in float64."""
    x = logits.astype(np.float64) / cfg.temperature
    keep = np.ones(x.shape, bool)
    order = np.argsort(-x, kind="stable")
    if cfg.top_k:
        keep[order[cfg.top_k:]] = False
    if cfg.top_p < 1.0:
        p = np.where(keep, np.exp(x - x.max()), 0.0)
        p /= p.sum()
        before = np.cumsum(p[order]) - p[order]
        keep[order[before >= cfg.top_p]] = False
    w = np.where(keep, np.exp(x - x.max()), 0.0)
    return w / w.sum()


def _counts(logits, cfg, seed=0, rows=DRAWS, calls=1):
    """Token counts of `rows * calls` draws from `logits` (one row per draw)."""
    draw = jax.jit(sample_tokens, static_argnums=2)
    batch = jnp.broadcast_to(jnp.asarray(logits), (rows, logits.shape[0]))
    tokens = [draw(batch, jax.random.PRNGKey(seed * 1000 + c), cfg)[0] for c in range(calls)]
    return np.bincount(np.asarray(jnp.concatenate(tokens)), minlength=logits.shape[0])


def _p_value(counts, probs):
    support = probs > 0
    return stats.chisquare(counts[support], counts.sum() * probs[support]).pvalue


def test_the_default_draw_is_jax_random_categorical():
    assert SamplingConfig().draw == "gumbel"
    logits = jax.random.normal(jax.random.PRNGKey(3), (6, 300)) * 2
    for cfg in (SamplingConfig(temperature=0.7), SamplingConfig(top_k=20, top_p=0.9)):
        for seed in range(3):
            key = jax.random.PRNGKey(seed)
            tokens, _ = sample_tokens(logits, key, cfg)
            want = jax.random.categorical(key, _filter(logits / cfg.temperature, cfg), axis=-1)
            np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want))


def test_gumbel_max_is_jax_random_categorical_at_the_samplers_shapes():
    # A [8, 32000] batch as the small preset decodes, a third of it filtered, and the
    # speculative sampler's [B, k, V] residual draw; jitted, 40 keys each.
    logits = jax.random.normal(jax.random.PRNGKey(4), (8, 32000)) * 3
    logits = logits.at[:, 5000:15000].set(-jnp.inf).at[3].set(-jnp.inf).at[3, 7].set(0.0)
    cube = jax.random.normal(jax.random.PRNGKey(5), (4, 3, 500))
    ours = jax.jit(gumbel_max)
    ref = jax.jit(lambda k, x: jax.random.categorical(k, x, axis=-1))
    for seed in range(40):
        key = jax.random.PRNGKey(100 + seed)
        for x in (logits, cube):
            got, want = np.asarray(ours(key, x)), np.asarray(ref(key, x))
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, want)
    assert int(ours(jax.random.PRNGKey(0), logits)[3]) == 7  # the one live token of row 3


def test_the_unrolled_noise_is_jax_random_gumbels_bits():
    # Raw and typed keys, 1-D to 3-D shapes, jitted and vmapped over keys: every bit.
    shapes = [(8, 32000), (7,), (4, 3, 500), (1, 1)]
    keys = [jax.random.PRNGKey(s) for s in (0, 1, 2**31 + 5)] + [jax.random.key(9)]
    ours = jax.jit(gumbel, static_argnums=1)
    for key in keys:
        for shape in shapes:
            want = jax.random.gumbel(key, shape)
            got = ours(key, shape)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        words = jax.random.key_data(key) if key.dtype != jnp.uint32 else key
        np.testing.assert_array_equal(threefry_bits(words, (3, 1000)),
                                      jax.random.bits(key, (3, 1000), jnp.uint32))
    batch = jax.random.split(jax.random.PRNGKey(3), 5)
    got = jax.jit(jax.vmap(lambda k: gumbel(k, (2, 300))))(batch)
    want = jax.vmap(lambda k: jax.random.gumbel(k, (2, 300)))(batch)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # No rolled Threefry loop left in the compiled draw: it is one fused pass.
    hlo = jax.jit(gumbel_max).lower(keys[0], jnp.zeros((8, 32000))).compile().as_text()
    assert " while(" not in hlo and "while." not in hlo


def test_the_noise_falls_back_to_jax_random_where_its_bits_differ():
    # bf16, the original (non-partitionable) counters, high-range Gumbel and another
    # PRNG each go to jax.random.gumbel itself: the same values as JAX's, whatever they are.
    key = jax.random.PRNGKey(11)
    np.testing.assert_array_equal(gumbel(key, (4, 64), jnp.bfloat16),
                                  jax.random.gumbel(key, (4, 64), jnp.bfloat16))
    for flag in ("jax_threefry_partitionable", "jax_high_dynamic_range_gumbel"):
        old = getattr(jax.config, flag)
        jax.config.update(flag, not old)
        try:
            np.testing.assert_array_equal(gumbel(key, (4, 64)), jax.random.gumbel(key, (4, 64)))
        finally:
            jax.config.update(flag, old)
    rbg = jax.random.key(5, impl="rbg")
    np.testing.assert_array_equal(gumbel(rbg, (4, 64)), jax.random.gumbel(rbg, (4, 64)))


def test_first_argmax_is_jnp_argmax():
    rng = np.random.RandomState(0)
    x = rng.randint(-3, 4, (16, 64)).astype(np.float32)  # many ties
    x[1] = -np.inf  # an all-filtered row: index 0
    x[2, [5, 9]] = np.nan  # the first NaN wins
    x[3] = -1.0
    x[3, 4], x[3, 6] = -0.0, 0.0  # -0 == +0: the first of them, 4
    x[4, :] = -1.0
    x[4, 10] = np.inf
    rows = [x, x.astype(jnp.bfloat16), x > 1, np.zeros((3, 7), bool),
            rng.randint(0, 5, (5, 9)).astype(np.int32)]
    for a in rows:
        for axis in (-1, 0):
            want = np.asarray(jnp.argmax(a, axis=axis))
            for f in (first_argmax, jax.jit(first_argmax, static_argnums=1)):
                got = np.asarray(f(a, axis))
                assert got.dtype == np.int32
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0),
                                                     (1.3, 5, 1.0), (0.9, 0, 0.8),
                                                     (0.8, 6, 0.9)])
def test_inverse_cdf_samples_the_exact_distribution(temperature, top_k, top_p):
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, draw="inverse_cdf")
    probs = _exact(LOGITS, cfg)
    counts = _counts(LOGITS, cfg)
    assert counts[probs == 0].sum() == 0, "a filtered token was drawn"
    p = _p_value(counts, probs)
    print(f"T={temperature} k={top_k} p={top_p}: chi-square p-value {p:.3g}")
    assert p >= P_MIN
    # The Gumbel draw passes the same test (the test is fair) ...
    assert _p_value(_counts(LOGITS, SamplingConfig(temperature=temperature, top_k=top_k,
                                                   top_p=top_p)), probs) >= P_MIN
    # ... and it sees a wrong distribution: the plain softmax, where it differs.
    if (temperature, top_k, top_p) != (1.0, 0, 1.0):
        assert _p_value(counts, _exact(LOGITS, SamplingConfig())) < P_MIN


def test_inverse_cdf_never_draws_a_filtered_token_of_a_large_vocabulary():
    rng = np.random.RandomState(0)
    logits = np.full(32000, -np.inf, np.float32)  # what a top-k / top-p filter leaves
    hot = rng.choice(32000, 8, replace=False)  # spread over the vocabulary, the last included
    hot[0] = 31999
    logits[hot] = rng.randn(8).astype(np.float32) + 3.0
    cfg = SamplingConfig(draw="inverse_cdf")
    probs = _exact(logits, cfg)
    counts = _counts(logits, cfg, seed=1, rows=1000, calls=10)  # [1000, 32000] a call
    assert counts[probs == 0].sum() == 0
    assert _p_value(counts, probs) >= P_MIN


def test_an_inverse_cdf_rollout_replays_bit_for_bit():
    cfg, params, loop = exactness_model("dense")
    kw = dict(policy=Policy.parse("fp32"), max_new_tokens=10, num_samples=2, eos_id=None, loop=loop,
              key=jax.random.PRNGKey(1))
    prompts = ((1, 5, 7), (2, 9, 4, 11, 3, 8), (6,))
    ro = generate(params, cfg, prompts, sampling=SamplingConfig(temperature=0.8,
                                                                draw="inverse_cdf"), **kw)
    gumbel = generate(params, cfg, prompts, sampling=SamplingConfig(temperature=0.8), **kw)
    assert not np.array_equal(np.asarray(ro.completion_tokens),
                              np.asarray(gumbel.completion_tokens))
    replay = replay_logprobs(params, cfg, Policy.parse("fp32"), ro)
    assert masked_max_abs_diff(replay, ro.logprobs, ro.completion_mask) == 0.0


def test_bad_draws_are_refused_by_name():
    with pytest.raises(ValueError, match="SamplingConfig.draw"):
        SamplingConfig(draw="gumble")
    with pytest.raises(ValueError, match="grpo.draw"):
        GRPOConfig(draw="gumble")
    with pytest.raises(ValueError, match="grpo.draw=gumbel"):
        GRPOConfig(draw="inverse_cdf", speculative="self:loops=1,k=4")
    assert GRPOConfig(draw="inverse_cdf").draw == "inverse_cdf"
