"""Speculative rollouts: exactness (greedy, distribution, log-probs, replay), the bounded drafter, errors.

Models are tiny and random (one layer, vocabulary 8) with a large init scale
so that distributions are peaked and the drafter disagrees with the target:
rejections and residual draws happen. Shapes are shared between tests so that
compiled programs are reused.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxrl_lp.models import forward, init_params
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rl.logprob_programs import jit_learner_logprobs
from jaxrl_lp.rollout import LoopSpec, SamplingConfig, generate
from jaxrl_lp.rollout.drafter import sampling_probs, self_drafter_config
from jaxrl_lp.rollout.generate import call_inputs, take_rows
from jaxrl_lp.rollout.replay import replay_logprobs
from jaxrl_lp.rollout.request import check_request
from jaxrl_lp.rollout.speculative import (
    SpecConfig,
    drafter_cache_bytes,
    speculative_generate,
    speculative_program,
)

TOL = 1e-5  # f32 verification chunks vs one f32 full forward: log-probs, absolute
N = 8
V = 8
TARGET = ModelConfig(family="ouro", vocab_size=V, hidden_size=32, num_layers=1, num_heads=2,
                     num_kv_heads=1, head_dim=16, intermediate_size=64, qk_norm=False,
                     loop_steps=2, max_position_embeddings=64, rope_theta=10_000.0, init_std=0.3)
# A short-context dense drafter: trained length 12, so a 5-token prompt plus 8 new tokens
# runs past it and the re-basing has to act.
DRAFTER = ModelConfig(family="qwen3", vocab_size=V, hidden_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, intermediate_size=64,
                      max_position_embeddings=12, rope_theta=10_000.0, init_std=0.3)
PROMPTS = [[5, 1, 3, 7, 2], [6, 6, 0, 1, 4]]  # equal lengths: one batched full forward
SELF = "self:loops=1,k=4"
DENSE = "dense:-,k=4,sink=2,window=5"


@functools.cache
def target_params():
    return init_params(TARGET, jax.random.PRNGKey(1))


@functools.cache
def drafter_params():
    return init_params(DRAFTER, jax.random.PRNGKey(2))


def spec_rollout(spec, **kw):
    drafter = (drafter_params(), DRAFTER) if spec.startswith("dense") else None
    return speculative_generate(target_params(), TARGET, PROMPTS, spec, drafter=drafter,
                                max_new_tokens=N, with_stats=True, **kw)


@functools.cache
def plain_greedy():
    return generate(target_params(), TARGET, PROMPTS, max_new_tokens=N)


@functools.cache
def greedy(spec):
    return spec_rollout(spec)


@jax.jit
def full_logprobs(params, tokens_BxT):
    """log_softmax of one cache-free f32 forward (the model's default `full` read-out)."""
    return jax.nn.log_softmax(forward(params, TARGET, Policy.parse("fp32"), tokens_BxT)[0], axis=-1)


# The dense drafter by default (15 s cold on 2 cores); the self-drafter (22 s), whose draws
# the chi-square test below checks by default, in the slow tier.
@pytest.mark.parametrize("spec", [pytest.param(SELF, marks=pytest.mark.slow),
                                  DENSE])
def test_greedy_equals_plain_greedy_token_for_token(spec):
    ro, st = greedy(spec)
    plain = plain_greedy()
    np.testing.assert_array_equal(ro.completion_tokens, plain.completion_tokens)
    np.testing.assert_array_equal(ro.completion_mask, plain.completion_mask)
    assert ro.verify_tokens == 5
    counts = np.asarray(ro.verify_counts)
    assert (counts.sum(1) == N - 1).all()  # every token after the prefill's was verified
    assert int(st.iterations) == (counts > 0).sum(1).max()


def test_rows_accept_different_counts_and_logprobs_equal_full_forward():
    ro, st = greedy(SELF)
    counts = np.asarray(ro.verify_counts)
    assert int(st.accepted) > 0 and (counts != counts[:1]).any()  # batched, ragged acceptance
    tokens = jnp.concatenate([jnp.asarray(PROMPTS), ro.completion_tokens], axis=1)
    lp = full_logprobs(target_params(), tokens)[:, len(PROMPTS[0]) - 1:-1]
    want = jnp.take_along_axis(lp, ro.completion_tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(ro.logprobs, want * ro.completion_mask, atol=TOL, rtol=0)


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_replay_equals_sampler_bit_for_bit(policy):
    ro, _ = spec_rollout(SELF, policy=Policy.parse(policy), sampling=SamplingConfig(temperature=0.7),
                         key=jax.random.PRNGKey(4)) if policy == "bf16" else greedy(SELF)
    replay = jit_learner_logprobs(TARGET, Policy.parse(policy), "replay")(target_params(), ro)
    mask = np.asarray(ro.completion_mask) > 0
    assert (np.asarray(replay)[mask] == np.asarray(ro.logprobs)[mask]).all()


def test_a_dense_drafters_rollout_replays_without_the_drafters_weights():
    """The replay runs the sampler's program with the drafts replaced: zeros of the drafter's
    recorded weight shapes stand in, nothing compiles, and the batch and each row alone
    replay the sampler's bits."""
    ro, st = spec_rollout(DENSE, sampling=SamplingConfig(temperature=0.7),
                          key=jax.random.PRNGKey(4))
    assert 0 < int(st.accepted) < int(st.proposed)  # drafts accepted and rejected
    (call,) = ro.calls
    assert call.speculative.drafter_cfg == DRAFTER and call.speculative.drafter_leaves
    compiled = speculative_program._cache_size()
    mask = np.asarray(ro.completion_mask) > 0
    for rows in (np.arange(2), np.array([1]), np.array([0])):
        got = replay_logprobs(target_params(), TARGET, Policy.parse("fp32"), take_rows(ro, rows))
        np.testing.assert_array_equal(np.asarray(got)[mask[rows]],
                                      np.asarray(ro.logprobs)[rows][mask[rows]])
    assert speculative_program._cache_size() == compiled


def test_one_row_path_is_exact_and_batched_rows_draft_as_alone():
    """A lone row (B = 1: in-place cache writes, no vmap) equals plain greedy and replays bit for
    bit; rows in a batch draft and accept exactly as they do alone."""
    alone = [speculative_generate(target_params(), TARGET, [p], SELF, max_new_tokens=N,
                                  with_stats=True) for p in PROMPTS]
    ro = alone[0][0]
    plain = generate(target_params(), TARGET, PROMPTS[:1], max_new_tokens=N)
    np.testing.assert_array_equal(ro.completion_tokens, plain.completion_tokens)
    replay = jit_learner_logprobs(TARGET, Policy.parse("fp32"), "replay")(target_params(), ro)
    np.testing.assert_array_equal(replay, ro.logprobs)
    _, st = greedy(SELF)
    assert int(st.accepted) == sum(int(s.accepted) for _, s in alone)
    assert int(st.proposed) == sum(int(s.proposed) for _, s in alone)


def _conditionals(params, cfg, prompt, sampling, depth):
    """`[p_t for t < depth]`: the sampler's conditional p(x_t | prompt, x_<t) of model `cfg`
    as an array [V] * t + [V] (f64), from one cache-free f32 forward over every completion
    of depth - 1 tokens (V ** (depth - 1) rows)."""
    grid = np.stack(np.meshgrid(*[np.arange(V)] * (depth - 1), indexing="ij"), -1)
    grid = grid.reshape(-1, depth - 1)
    tokens = jnp.concatenate([jnp.broadcast_to(jnp.asarray(prompt), (len(grid), len(prompt))),
                              jnp.asarray(grid, jnp.int32)], axis=1)
    logits = forward(params, cfg, Policy.parse("fp32"), tokens)[0]
    p = len(prompt)
    out = []
    for t in range(depth):
        probs = np.asarray(sampling_probs(logits[:, p - 1 + t], sampling), np.float64)
        probs = (probs / probs.sum(-1, keepdims=True)).reshape([V] * (depth - 1) + [V])
        out.append(probs[(slice(None),) * t + (0,) * (depth - 1 - t)])  # x_t reads x_<t only
    return out


SAMPLING = SamplingConfig(temperature=0.8)
DEPTH = 6  # tokens examined: the prefill's, then a k = 4 round's drafts and bonus


@functools.cache
def exact_conditionals(drafter_loops: int | None = None):
    """`_conditionals` of the target after PROMPTS[0] (or of its self-drafter truncated to
    `drafter_loops` loop steps), computed once for the tests that share them."""
    cfg = TARGET if drafter_loops is None else self_drafter_config(TARGET, drafter_loops)
    return _conditionals(target_params(), cfg, PROMPTS[0], SAMPLING, DEPTH)


def _target_marginals(p):
    """[depth, V] per-position marginals of plain sampling from the conditionals `p`."""
    joint, out = p[0], [p[0]]
    for pt in p[1:]:
        joint = joint[..., None] * pt
        out.append(joint.sum(axis=tuple(range(joint.ndim - 1))))
    return np.stack(out)


def _speculative_marginals(p, q, k, residual):
    """[depth, V] per-position marginals of what a speculative sampler emits, exactly.

    A Markov chain over (completion so far, where the next token stands in its round: draft
    1..k, or the bonus). Draft j of a round is drawn from q(. | x_<t) and accepted with
    probability min(1, p / q), so the emitted token is x with acceptance with probability
    min(p, q)(x), the round going on to draft j + 1 (or the bonus after draft k); else
    (probability 1 - beta, beta = sum min(p, q)) a token from the residual and a new round.
    The bonus is drawn from p, then a new round. `residual="exact"`: norm(max(p - q, 0)),
    whose marginals are the target's; `"p"`: the classic bug, resampling from p.
    """
    state = np.zeros((V, k + 1))
    state[:, 0] = p[0]  # the prefill's token, then draft 1 of the first round
    out = [p[0]]
    for pt, qt in zip(p[1:], q[1:], strict=True):
        accept = np.minimum(pt, qt)
        beta = accept.sum(-1, keepdims=True)
        if residual == "exact":
            r = np.maximum(pt - qt, 0.0)
            total = r.sum(-1, keepdims=True)
            r = np.where(total > 0, r / np.where(total > 0, total, 1.0), pt)
        else:
            r = pt
        reject = (1.0 - beta) * r
        new = np.zeros(pt.shape + (k + 1,))
        for j in range(k):  # the next token is draft j + 1 of its round
            w = state[..., j][..., None]
            new[..., j + 1] += w * accept
            new[..., 0] += w * reject
        new[..., 0] += state[..., k][..., None] * pt  # the bonus, then a new round
        state = new
        out.append(state.sum(axis=tuple(range(pt.ndim - 1)) + (pt.ndim,)))
    return np.stack(out)


def _chi2(counts, expected):
    """Chi-square p-value, cells with expected count < 5 pooled."""
    counts, expected = counts.ravel(), np.asarray(expected, np.float64).ravel()
    small = expected < 5
    c = np.append(counts[~small], counts[small].sum())
    e = np.append(expected[~small], expected[small].sum())
    keep = e > 0
    e = e[keep] / e[keep].sum() * c[keep].sum()
    return stats.chisquare(c[keep], e * (c[keep].sum() / e.sum())).pvalue


DRAWS = 4000


# The self-drafter at k = 4 by default (27 s cold on 2 cores); the dense drafter (23 s) and
# k = 1 (one draft a round; the k = 4 cell runs the same self-drafter with four drafts and
# a bonus a round) in the slow tier.
@pytest.mark.parametrize("spec", [
    pytest.param("self:loops=1,k=1", marks=pytest.mark.slow),
    "self:loops=1,k=4",
    pytest.param("dense:-,k=4,sink=2,window=5", marks=pytest.mark.slow)])
def test_every_drafted_and_bonus_token_follows_the_target_chi_square(spec):
    """Per-position marginals of the first 6 tokens (the prefill's, then the drafts and
    bonuses of the rounds that cover them: for k = 4 the first round's 4 drafts and its
    bonus) against the target's, exactly computed; for the self-drafter, whose q is the
    truncated target's (one full forward), the same counts refuse the exactly computed
    marginals of the wrong-residual bug. (The dense drafter's q depends on its ring cache's
    history, stale drafts included, so it is not computed here.)"""
    sampling, prompt, depth = SAMPLING, PROMPTS[0], DEPTH
    k = SpecConfig.parse(spec).k
    drafter = (drafter_params(), DRAFTER) if spec.startswith("dense") else None
    ro, st = speculative_generate(target_params(), TARGET, [prompt], spec, drafter=drafter,
                                  sampling=sampling, max_new_tokens=depth, num_samples=DRAWS,
                                  key=jax.random.PRNGKey(7), with_stats=True)
    # Acceptances and residual draws both happen, and rows take the first round's bonus
    # (measured: 1947, 276 and 11 of the 4000 rows).
    assert 0.05 < st.acceptance_rate < 0.95
    bonus_rows = int((np.asarray(ro.verify_counts)[:, 0] == k + 1).sum())
    assert bonus_rows >= 10, bonus_rows
    toks = np.asarray(ro.completion_tokens)
    counts = np.stack([np.bincount(toks[:, t], minlength=V) for t in range(depth)])
    p = exact_conditionals()
    want = _target_marginals(p)
    pvals = [_chi2(counts[t], DRAWS * want[t]) for t in range(depth)]
    print(f"{spec}: acceptance {st.acceptance_rate:.3f}, {bonus_rows} bonus rows, "
          f"chi-square p-values by position {np.round(pvals, 4).tolist()}")
    assert min(pvals) > 1e-3
    if spec.startswith("self"):
        q = exact_conditionals(drafter_loops=1)
        # The chain itself: with the right residual it gives the target's marginals.
        np.testing.assert_allclose(_speculative_marginals(p, q, k, "exact"), want, rtol=0,
                                   atol=1e-12)
        wrong = _speculative_marginals(p, q, k, "p")
        bug = [_chi2(counts[t], DRAWS * wrong[t]) for t in range(1, depth)]
        print(f"  against the wrong residual (resampling from p): {bug}")
        assert max(np.abs(wrong - want).sum(1)) > 0.05  # the bug moves the marginals...
        assert max(bug) < 1e-6  # ...and these counts see it at every position after the first


def test_dense_drafter_cache_is_bounded_and_positions_rebased(monkeypatch):
    """The drafter's cache a run carries is the same at two context lengths: sink + window slots.

    The re-basing is read off a run (`greedy(DENSE)`). The cache is read off the sampler's
    program: `draft` is wrapped to record the arrays of the drafter's cache state that the
    decode loop hands it (and the target's cache beside them), and the program
    (`speculative_program`, with the inputs `speculative_generate` gives it) is traced
    (`jax.eval_shape`) at two context lengths, prompts of 10 and 30 tokens (bucketed to 16
    and 32) + 8 new. A jitted loop's state has fixed shapes, so these are the buffers the
    compiled run allocates; tracing costs no compilation (two compiled runs cost ~16 s of CPU).
    """
    import jaxrl_lp.rollout.speculative as speculative

    _, st = greedy(DENSE)
    # Prompt 5 + 8 new tokens + drafts run past the trained length of 12: re-based, the
    # drafter's positions stay below it (without re-basing they do not: the slow test).
    assert int(st.max_draft_position) < DRAFTER.max_position_embeddings

    nbytes = lambda tree: sum(int(np.prod(x.shape)) * x.dtype.itemsize
                              for x in jax.tree.leaves(tree))
    seen = []  # (drafter cache bytes, its slot axis, target cache bytes), one per trace

    def measured_draft(spec, state, params, cfg, dparams, dcfg, policy, sampling, target_cache,
                       *args):
        seen.append((nbytes(state.cache), state.cache["pos"].shape[1], nbytes(target_cache)))
        return draft(spec, state, params, cfg, dparams, dcfg, policy, sampling, target_cache,
                     *args)

    draft = speculative.draft
    monkeypatch.setattr(speculative, "draft", measured_draft)
    spec = SpecConfig.parse(DENSE).resolve(TARGET, DRAFTER)
    rng = np.random.RandomState(3)
    per_context = {}
    for context in (10, 30):  # both past the trained length (12) and sink + window (7)
        seen.clear()
        prompts = [list(rng.randint(0, V, context)) for _ in range(2)]
        req = check_request(prompts, TARGET, sampling=SamplingConfig(greedy=True), max_new_tokens=N,
                            num_samples=1, eos_id=None, pad_id=0, key=None, draft_slots=spec.k)
        zeros = np.zeros((2, N), np.int32)
        args = call_inputs(req.tokens_BxP, req.positions_BxP, req.lengths_B, req.key, 0, zeros,
                           zeros, False, counts_BxN=zeros)
        jax.eval_shape(functools.partial(
            speculative.speculative_program, cfg=TARGET, dcfg=DRAFTER, spec=spec,
            policy=Policy.parse("fp32"), loop=LoopSpec().resolve(TARGET),
            sampling=SamplingConfig(greedy=True), max_new_tokens=N, eos_id=None, pad_id=0,
            layout="as_stored"), target_params(), drafter_params(), *args)
        assert len(set(seen)) == 1, f"the loop was not traced, or carries other sizes: {seen}"
        per_context[context] = seen[0]
    (short_d, short_slots, short_t), (long_d, long_slots, long_t) = per_context.values()
    assert long_t > short_t  # the target's cache holds the context; the probe sees its size
    assert long_d == short_d == drafter_cache_bytes(spec, DRAFTER, Policy.parse("fp32"), 2) > 0
    assert long_slots == short_slots == spec.sink + spec.window
    # k and v [B=2, kv heads, 7 slots, head dim] f32 per layer, and the slots' int32 positions.
    assert short_d == DRAFTER.num_layers * 2 * (2 * DRAFTER.num_kv_heads * 7
                                                * DRAFTER.head_dim * 4) + 2 * 7 * 4
    assert drafter_cache_bytes(SpecConfig.parse(SELF), None, Policy.parse("fp32"), 1) == 0


def test_bad_input_gives_one_clear_error_each():
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        SpecConfig.parse("self:loops=1,k=0")
    other = DRAFTER.replace(vocab_size=V + 1)
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(target_params(), TARGET, PROMPTS, DENSE,
                             drafter=(init_params(other, jax.random.PRNGKey(0)), other))
    with pytest.raises(ValueError, match="trained length"):
        SpecConfig.parse("dense:-,k=4,sink=2,window=12").resolve(TARGET, DRAFTER)
    with pytest.raises(ValueError, match="fewer loop steps"):
        SpecConfig.parse("self:loops=2,k=4").resolve(TARGET)
    with pytest.raises(ValueError, match="starts with"):
        SpecConfig.parse("fast:k=4")
    assert str(SpecConfig.parse("dense:/a/b,k=3,sink=1,window=9,rebase=false")) == \
        "dense:/a/b,k=3,sink=1,window=9,rebase=false"
    assert str(SpecConfig.parse(SELF)) == SELF



@pytest.mark.parametrize("bad", [
    {"max_new_tokens": 0}, {"num_samples": 0}, {"prompts": []}, {"prompts": [[1, 2], []]},
    {"prompts": [[1, V]]}, {"pad_id": V}, {"eos_id": -1},
    {"sampling": SamplingConfig(temperature=1.0)},  # sampling without a key
])
def test_a_bad_request_gets_the_same_error_from_both_samplers(bad):
    """Both samplers check a request with `rollout.request.check_request`, before tracing."""
    kw = {"prompts": PROMPTS, "max_new_tokens": N, **bad}
    prompts = kw.pop("prompts")
    with pytest.raises(ValueError) as plain:
        generate(target_params(), TARGET, prompts, **kw)
    with pytest.raises(ValueError) as spec:
        speculative_generate(target_params(), TARGET, prompts, SELF, **kw)
    assert str(spec.value) == str(plain.value)


def test_a_prompt_past_the_context_names_the_draft_slots():
    ctx = TARGET.max_position_embeddings
    long = [[1] * (ctx - N)]  # fits with the new tokens, not with k = 4 more draft slots
    check_request(long, TARGET, sampling=SamplingConfig(greedy=True), max_new_tokens=N,
                  num_samples=1, eos_id=None, pad_id=0, key=None)  # what generate checks
    with pytest.raises(ValueError, match=rf"plus max_new_tokens={N} and k=4 draft slots "
                                         rf"exceeds the model's context of {ctx} tokens"):
        speculative_generate(target_params(), TARGET, long, SELF, max_new_tokens=N)


def _affine_batch(rng, b, length):
    """Sequences [key, s, s + key, s + 2 key, ...] mod V: every next token needs the first one."""
    key = rng.randint(1, V, (b, 1))
    start = rng.randint(0, V, (b, 1))
    return np.concatenate([key, (start + key * np.arange(length - 1)[None]) % V], 1)


def _train_affine(length, steps, seed):
    """A 1-layer dense model trained on `_affine_batch` sequences of `length` (its trained length)."""
    import optax

    cfg = ModelConfig(family="qwen3", vocab_size=V, hidden_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=128,
                      max_position_embeddings=length, rope_theta=10_000.0)
    params = init_params(cfg, jax.random.PRNGKey(seed))
    opt = optax.adam(3e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state, tokens):
        def loss(p):  # positions 2.. are determined by the key and the previous token
            lp = jax.nn.log_softmax(forward(p, cfg, Policy.parse("fp32"), tokens)[0][:, 1:-1])
            return -jnp.mean(jnp.take_along_axis(lp, tokens[:, 2:, None], axis=-1))

        g = jax.grad(loss)(params)
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state

    rng = np.random.RandomState(seed)
    for _ in range(steps):
        params, state = step(params, state, jnp.asarray(_affine_batch(rng, 64, length)))
    return params, cfg


@pytest.mark.slow
# 52 s on 2 shared cores, most of it training the two models
def test_rebasing_keeps_acceptance_past_the_drafters_trained_length():
    """A drafter trained on 16-token sequences drafts for a target trained on 64-token ones.

    Each next token needs the first one (the key), at any distance: past 16
    tokens the un-rebased drafter attends to it at distances it never saw and
    its acceptance falls; re-based, every distance stays below 16.
    """
    drafter = _train_affine(16, 400, 1)
    target = _train_affine(64, 400, 2)
    rng = np.random.RandomState(5)
    acc = {}
    for name, prompt_len, new in (("short", 5, 8), ("long", 40, 20)):
        prompts = [list(r) for r in _affine_batch(rng, 16, prompt_len)]
        for rebase in (True, False):
            spec = f"dense:-,k=3,sink=4,window=8,rebase={str(rebase).lower()}"
            _, st = speculative_generate(*target, prompts, spec, drafter=drafter,
                                         max_new_tokens=new, with_stats=True)
            acc[name, rebase] = st.acceptance_rate
            if rebase:
                assert int(st.max_draft_position) < 16
            elif name == "long":
                assert int(st.max_draft_position) >= 16
    print(acc)
    assert acc["long", True] > acc["short", True] - 0.2
    assert acc["long", False] < acc["long", True] - 0.08
