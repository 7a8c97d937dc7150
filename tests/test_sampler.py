"""The sampler against full forwards: greedy, log-probs, deferred looped decoding, filters, batching.

Reference: a cache-free forward over the whole sequence (prompt + completion).
By causality its logits at position i depend only on tokens <= i, so checking
that every sampled token is the argmax of the full forward at the position
before it is the same as checking against greedy decoding by repeated full
forwards (by induction over the generated tokens), at one forward's cost.

Every test runs the jitted sampler at tiny sizes; shapes are shared between
tests (B=2 rows, prompts bucketed to P=8, N new tokens) so compiled programs
are reused.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxrl_lp.models import ExitSchedule, forward, get_preset, init_params, unstack_layers
from jaxrl_lp.models.cache import init_cache
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rollout import LoopSpec, SamplingConfig, decode_step, generate, prefill
from jaxrl_lp.rollout.generate import pad_prompts, sampler_program

TOL = 1e-5  # f32 sampler (cached, one token at a time) vs f32 full forward: log-probs, absolute
N = 6  # new tokens
DENSE = get_preset("tiny-qwen3")
LOOPED = get_preset("tiny-ouro")
R = LOOPED.loop_steps
THRESHOLD = "threshold:0.5"
RULES = ["full", "fixed:2", THRESHOLD]
PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 81, 12, 64]]  # equal lengths: one batched reference


@functools.cache
def dense_params():
    return init_params(DENSE, jax.random.PRNGKey(0))


@functools.cache
def looped_params():
    """Random Ouro weights whose exit gate spreads exits over all four steps.

    Gate logits ~ N(-1, 0.25 * sqrt(64) = 2): under `threshold:0.5` about
    45% of tokens exit at step 0 and the rest spread over steps 1..3.
    """
    p = init_params(LOOPED, jax.random.PRNGKey(1))
    p["exit_gate"] = {"kernel": 0.25 * jax.random.normal(jax.random.PRNGKey(5), (64, 1)),
                      "bias": jnp.array([-1.0])}
    return p


def params_of(cfg):
    return looped_params() if cfg.is_looped else dense_params()


@functools.partial(jax.jit, static_argnames=("cfg", "compute_mode"))
def full_forward(params, tokens_BxT, exit_steps_BxT=None, readout_steps_BxT=None, *, cfg,
                 compute_mode="dense"):
    """Cache-free f32 forward; looped: returns (logits, exit pdf) at the given read-out steps."""
    if not cfg.is_looped:
        return forward(params, cfg, Policy.parse("fp32"), tokens_BxT)[0], None
    logits, _, out = forward(params, cfg, Policy.parse("fp32"), tokens_BxT,
                             loop=LoopSpec("full", compute_mode),
                             schedule=ExitSchedule(exit_steps_BxT, readout_steps_BxT))
    return logits, out.exit_pdf


def rule_exits(pdf_BxTxR, rule):
    """The exit step each rule picks from an exit distribution (independent numpy reference)."""
    b, t, r = pdf_BxTxR.shape
    kind, *args = rule.split(":")
    if kind == "full":
        return np.full((b, t), r - 1)
    if kind == "fixed":
        return np.full((b, t), int(args[0]) - 1)
    cum = np.cumsum(pdf_BxTxR, axis=-1)
    min_loops = int(args[1]) if len(args) > 1 else 1
    ok = (cum >= float(args[0])) & (np.arange(r) + 1 >= min_loops)
    ok[..., -1] = True
    return np.argmax(ok, axis=-1)


def sequence(ro, prompts):
    """prompt + completion of each row (equal-length prompts), and the prompt length."""
    prompt = np.repeat(np.asarray(prompts), len(ro.completion_tokens) // len(prompts), axis=0)
    return np.concatenate([prompt, np.asarray(ro.completion_tokens)], axis=1), prompt.shape[1]


def log_softmax(x, temperature):
    x = np.asarray(x, np.float64) / temperature
    return x - np.log(np.sum(np.exp(x - x.max(-1, keepdims=True)), -1, keepdims=True)) \
        - x.max(-1, keepdims=True)


def check_against_full(ro, logits_BxTxV, p, temperature, greedy):
    """Sampled tokens (argmax if greedy) and log-probs against the full forward's logits."""
    comp = np.asarray(ro.completion_tokens)
    lg = np.asarray(logits_BxTxV)[:, p - 1: p - 1 + comp.shape[1]]  # logits that chose token j
    want_lp = np.take_along_axis(log_softmax(lg, temperature), comp[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(ro.logprobs), want_lp, rtol=0, atol=TOL)
    if greedy:
        top2 = np.sort(lg, axis=-1)[..., -2:]
        assert (top2[..., 1] - top2[..., 0]).min() > 10 * TOL  # no near-ties: argmax is decisive
        np.testing.assert_array_equal(comp, lg.argmax(-1))


def looped_readout_logits(params, tokens, rule):
    """Dense-mode full forward read out where `rule` says, and the per-token exit steps."""
    b, t = tokens.shape
    steps = [full_forward(params, tokens, readout_steps_BxT=jnp.full((b, t), r, jnp.int32),
                          cfg=LOOPED) for r in range(R)]
    logits_R = np.stack([np.asarray(s[0]) for s in steps])
    exits = rule_exits(np.asarray(steps[0][1]), rule)  # the trajectory does not depend on r
    return np.take_along_axis(logits_R, exits[None, ..., None], 0)[0], exits


# ---------------------------------------------------------------- greedy == full forward
def test_dense_greedy_is_argmax_of_full_forward_and_logprobs_match():
    params = dense_params()
    sampling = SamplingConfig(greedy=True)
    ro = generate(params, DENSE, PROMPTS, sampling=sampling, max_new_tokens=N)
    assert ro.completion_tokens.shape == (2, N) and ro.logprobs.dtype == jnp.float32
    assert str(ro.loop) == "full/dense" and ro.temperature == 1.0 and ro.policy == (Policy.parse("fp32"))
    np.testing.assert_array_equal(ro.completion_mask, 1.0)
    np.testing.assert_array_equal(ro.exit_steps, 0)
    seq, p = sequence(ro, PROMPTS)
    logits, _ = full_forward(params, jnp.asarray(seq), cfg=DENSE)
    check_against_full(ro, logits, p, 1.0, greedy=True)

    # New prompt contents and lengths in the same bucket reuse the compiled program.
    compiled = sampler_program._cache_size()
    generate(params, DENSE, [[1, 2, 3], [4, 5, 6, 7, 8, 9]], sampling=sampling, max_new_tokens=N)
    assert sampler_program._cache_size() == compiled


@pytest.mark.parametrize("rule", RULES)
def test_looped_greedy_is_argmax_of_full_forward_every_exit_rule(rule):
    params = looped_params()
    temperature = 1.7 if rule == THRESHOLD else 1.0  # log-probs are taken after temperature
    ro = generate(params, LOOPED, PROMPTS, max_new_tokens=N, loop=LoopSpec(rule, "dense"),
                  sampling=SamplingConfig(greedy=True, temperature=temperature))
    assert ro.loop == LoopSpec(rule, "dense") and str(ro.loop) == f"{LoopSpec(rule).exit_rule}/dense"
    seq, p = sequence(ro, PROMPTS)
    logits, exits = looped_readout_logits(params, jnp.asarray(seq), rule)
    check_against_full(ro, logits, p, temperature, greedy=True)
    # The recorded schedule is the rule's exit step of the token that produced each output.
    np.testing.assert_array_equal(ro.exit_steps, exits[:, p - 1: p - 1 + N])
    if rule == THRESHOLD:
        assert len(np.unique(exits)) >= 3  # the gate really spreads the exits
    assert int(ro.loop_evals) == R * (N - 1)  # dense mode: every decode step runs all R


def test_sampled_logprobs_equal_full_forward_log_softmax():
    """Non-greedy draws: the log-prob at temperature T of the drawn (often not argmax) token.

    Looped models run the same `sample_tokens` on their read-out logits, whose
    log-probs the looped tests check at T=1.7.
    """
    params = dense_params()
    prompts = PROMPTS[:1]
    ro = generate(params, DENSE, prompts, sampling=SamplingConfig(temperature=1.7, top_k=50),
                  max_new_tokens=N, num_samples=2, key=jax.random.PRNGKey(3))
    seq, p = sequence(ro, prompts)
    logits = full_forward(params, jnp.asarray(seq), cfg=DENSE)[0]
    check_against_full(ro, logits, p, 1.7, greedy=False)
    comp = np.asarray(ro.completion_tokens)
    assert (comp != np.asarray(logits)[:, p - 1: p - 1 + N].argmax(-1)).any()  # really sampled
    assert (comp[0] != comp[1]).any()  # the G samples of a prompt differ


# ---------------------------------------------------------------- deferred mode
def test_deferred_without_early_exit_is_exactly_dense():
    params = looped_params()
    dense, deferred = (generate(params, LOOPED, PROMPTS, max_new_tokens=N,
                                loop=LoopSpec("full", mode)) for mode in ("dense", "deferred"))
    np.testing.assert_array_equal(deferred.completion_tokens, dense.completion_tokens)
    np.testing.assert_array_equal(deferred.logprobs, dense.logprobs)  # bit for bit
    np.testing.assert_array_equal(deferred.exit_steps, R - 1)
    assert int(deferred.loop_evals) == int(dense.loop_evals) == R * (N - 1)


def test_deferred_early_exit_schedule_logprobs_and_loop_count():
    """Deferred rollout == deferred full-sequence replay of its schedule; compute falls."""
    params = looped_params()
    ro = generate(params, LOOPED, PROMPTS, max_new_tokens=N, loop=LoopSpec(THRESHOLD, "deferred"))
    exits = np.asarray(ro.exit_steps)
    assert 0 < exits.mean() < R - 1
    # Inputs: prompt (full depth) then completion tokens 0..N-2; the input at position
    # p-1+j stops at exits[:, j] (the last prompt token runs at full depth but reads out
    # at exits[:, 0]).
    seq, p = sequence(ro, PROMPTS)
    seq = seq[:, :-1]
    b, t = seq.shape
    compute = np.full((b, t), R - 1)
    compute[:, p:] = exits[:, 1:]
    readout = compute.copy()
    readout[:, p - 1] = exits[:, 0]
    logits, pdf = full_forward(params, jnp.asarray(seq), jnp.asarray(compute, jnp.int32),
                               jnp.asarray(readout, jnp.int32), cfg=LOOPED,
                               compute_mode="deferred")
    check_against_full(ro, logits, p, 1.0, greedy=True)
    # The rule applied to each token's own exit distribution gives the recorded schedule.
    np.testing.assert_array_equal(exits, rule_exits(np.asarray(pdf), THRESHOLD)[:, p - 1:])
    # Loop steps stop when the whole batch has exited: max exit + 1 per decode step.
    assert int(ro.loop_evals) == int((exits[:, 1:].max(0) + 1).sum()) < R * (N - 1)


def test_finished_sequences_do_not_hold_the_deferred_loop():
    """A sequence past its EOS is not computed, so it cannot keep a decode step looping.

    The pad token (fed to finished sequences) gets an embedding the exit gate reads
    as "do not exit" (alone it exits at step 2 or 3), while row 0's tokens all exit
    at step 0; row 1 ends after two tokens.
    """
    params = dict(looped_params())
    u = jax.random.normal(jax.random.PRNGKey(7), (LOOPED.hidden_size,))
    u = u / jnp.linalg.norm(u)
    params["embed"] = params["embed"].at[0].set(16.0 * u)
    params["exit_gate"] = {"kernel": (-12.0 * u)[:, None], "bias": jnp.array([8.0])}
    loop = LoopSpec(THRESHOLD, "deferred")
    free = generate(params, LOOPED, PROMPTS, max_new_tokens=N, loop=loop)
    eos = int(free.completion_tokens[1, 1])
    ro = generate(params, LOOPED, PROMPTS, max_new_tokens=N, loop=loop, eos_id=eos)
    mask, exits = np.asarray(ro.completion_mask) > 0, np.asarray(ro.exit_steps)
    assert mask[1].sum() == 2 and mask[0].all() and (exits[0] == 0).all()
    # Each decode step runs to the deepest exit among the sequences still generating:
    # 4 loop steps for the first (row 1's second token exits at the last step), then 1.
    want = sum(int(exits[mask[:, j], j].max()) + 1 for j in range(1, N) if mask[:, j].any())
    assert int(ro.loop_evals) == want == R + (N - 2)
    # The live row is unaffected by its finished neighbour.
    np.testing.assert_array_equal(np.asarray(ro.completion_tokens)[0],
                                  np.asarray(free.completion_tokens)[0])
    np.testing.assert_array_equal(np.asarray(ro.logprobs)[0], np.asarray(free.logprobs)[0])


@functools.partial(jax.jit, static_argnames=("loop",))
def _prefill_and_step(params, prompt, positions, token, *, loop):
    policy = Policy.parse("fp32")
    cache = init_cache(LOOPED, policy, prompt.shape[0], prompt.shape[1] + 1)
    _, cache, _, _ = prefill(params, LOOPED, policy, LoopSpec(THRESHOLD, "dense"), prompt,
                             positions, cache)
    pos = jnp.max(positions, axis=1) + 1
    _, cache, exits, evals = decode_step(params, LOOPED, policy, loop, token, pos, cache,
                                         prompt.shape[1])
    return cache, exits, evals


def test_deferred_kv_of_exited_token_at_deeper_steps_is_its_exit_step_kv():
    params = looped_params()
    prompt, positions, _ = pad_prompts(PROMPTS * 2, pad_id=0)
    token = jnp.array([3, 50, 101, 9], jnp.int32)
    args = (params, jnp.asarray(prompt), jnp.asarray(positions), token)
    deferred, exits, evals = _prefill_and_step(*args, loop=LoopSpec(THRESHOLD, "deferred"))
    dense, exits_dense, evals_dense = _prefill_and_step(*args, loop=LoopSpec(THRESHOLD, "dense"))
    exits = np.asarray(exits)
    np.testing.assert_array_equal(exits, exits_dense)  # same trajectory up to the exit
    assert len(np.unique(exits)) >= 2 and exits.max() < R - 1, exits
    assert int(evals) == exits.max() + 1 < int(evals_dense) == R
    slot = prompt.shape[1]
    for name in ("k", "v"):
        kv_d, kv_f = np.asarray(deferred[name]), np.asarray(dense[name])  # [R, L, B, K, S, Dh]
        np.testing.assert_array_equal(kv_d[..., :slot, :], kv_f[..., :slot, :])  # prompt
        for b, e in enumerate(exits):
            own = kv_d[:, :, b, :, slot]
            np.testing.assert_allclose(own[: e + 1], kv_f[: e + 1, :, b, :, slot], rtol=0,
                                       atol=1e-6)
            for d in range(e + 1, R):
                np.testing.assert_array_equal(own[d], own[e])  # exactly the exit-step K/V
            if e + 1 < R:
                assert not np.allclose(kv_f[e + 1, :, b, :, slot], own[e])  # dense differs there


@pytest.mark.parametrize("layout", ["as_stored", "transposed"])
def test_unstacked_params_give_the_same_rollout(layout):
    """`generate` unstacks the layers itself; passing them unstacked (in the same layout)
    changes nothing, and the rollout records the layout either way."""
    params = looped_params()
    kw = dict(max_new_tokens=N, loop=LoopSpec(THRESHOLD, "deferred"))
    a = generate(params, LOOPED, PROMPTS, decode_layout=layout, **kw)
    unstacked = unstack_layers(params, transpose=layout == "transposed")
    b = generate(unstacked, LOOPED, PROMPTS, **kw)
    assert a.decode_layout == b.decode_layout == layout
    for name in ("completion_tokens", "logprobs", "exit_steps", "loop_evals"):
        np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)))
    with pytest.raises(ValueError, match="unstacked as"):
        generate(unstacked, LOOPED, PROMPTS,
                 decode_layout={"as_stored": "transposed"}.get(layout, "as_stored"), **kw)


# ---------------------------------------------------------------- ragged prompts and G samples
@pytest.mark.parametrize("cfg", [DENSE, LOOPED], ids=["dense", "looped-deferred"])
def test_ragged_prompts_and_groups_equal_each_prompt_alone(cfg):
    params = params_of(cfg)
    loop = LoopSpec(THRESHOLD, "deferred")
    ragged = [[5, 17, 3], [7, 7, 81, 12, 64, 1, 2], [11, 22, 33, 44, 55]]
    g = 2
    alone = [generate(params, cfg, [pr], num_samples=g, max_new_tokens=N, loop=loop)
             for pr in ragged]
    eos = int(alone[0].completion_tokens[0, 2]) if not cfg.is_looped else None
    batch = generate(params, cfg, ragged, num_samples=g, max_new_tokens=N, loop=loop, eos_id=eos)
    np.testing.assert_array_equal(batch.prompt_lengths, np.repeat([3, 7, 5], g))
    for i, a in enumerate(alone):
        rows = slice(i * g, (i + 1) * g)
        tok, lp = np.asarray(a.completion_tokens), np.asarray(a.logprobs)
        mask = np.ones_like(lp)
        if eos is not None:  # the run stops each row at its first EOS, then pads
            for r in range(g):
                hits = np.flatnonzero(tok[r] == eos)
                if hits.size:
                    mask[r, hits[0] + 1:] = 0
            tok = np.where(mask > 0, tok, 0)
            lp = lp * mask
        np.testing.assert_array_equal(batch.completion_tokens[rows], tok)
        np.testing.assert_array_equal(batch.completion_mask[rows], mask)
        np.testing.assert_allclose(batch.logprobs[rows], lp, rtol=0, atol=TOL)
        np.testing.assert_array_equal(batch.exit_steps[rows], np.asarray(a.exit_steps) * mask)
    if eos is not None:
        assert (np.asarray(batch.completion_mask) == 0).any()  # EOS really cut a row short


# ---------------------------------------------------------------- sampling filters
V_LOGITS = np.array([2.0, 1.5, 1.2, 0.7, 0.3, 0.0, -0.5, -1.5], np.float32)
DRAWS = 20_000


def _expected(cfg: SamplingConfig):
    p = np.exp(V_LOGITS.astype(np.float64) / cfg.temperature)
    p /= p.sum()
    keep = np.ones_like(p, bool)
    order = np.argsort(-p)
    if cfg.top_k:
        keep[order[cfg.top_k:]] = False
    q = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
    if cfg.top_p < 1:
        before = np.cumsum(q[order]) - q[order]
        keep[order[before >= cfg.top_p]] = False
    q = np.where(keep, p, 0)
    return q / q.sum(), keep


@functools.partial(jax.jit, static_argnames=("cfg",))
def _draw(key, cfg):
    from jaxrl_lp.rollout import sample_tokens

    logits = jnp.broadcast_to(jnp.asarray(V_LOGITS), (DRAWS, V_LOGITS.size))
    return sample_tokens(logits, key, cfg)


@pytest.mark.parametrize("cfg", [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.5),
    SamplingConfig(temperature=2.5),
    SamplingConfig(temperature=1.3, top_k=3),
    SamplingConfig(temperature=1.0, top_p=0.6),
    SamplingConfig(temperature=0.8, top_k=5, top_p=0.75),
], ids=lambda c: f"T{c.temperature}-k{c.top_k}-p{c.top_p}")
def test_sampling_filters_chi_square(cfg):
    tokens, lps = _draw(jax.random.PRNGKey(11), cfg)
    counts = np.bincount(np.asarray(tokens), minlength=V_LOGITS.size)
    want, keep = _expected(cfg)
    assert counts[~keep].sum() == 0  # filtered tokens are never drawn
    _, pval = stats.chisquare(counts[keep], DRAWS * want[keep])
    assert pval > 1e-3, (counts, DRAWS * want)
    if not keep.all():  # the test has power: the counts reject the unfiltered distribution
        unfiltered, _ = _expected(SamplingConfig(temperature=cfg.temperature))
        assert stats.chisquare(counts, DRAWS * unfiltered).pvalue < 1e-6
    # The log-probs are of the tempered, unfiltered distribution (what the learner computes).
    full_lp = log_softmax(V_LOGITS, cfg.temperature)
    np.testing.assert_allclose(np.asarray(lps), full_lp[np.asarray(tokens)], rtol=0, atol=TOL)


# ---------------------------------------------------------------- bad input
def test_bad_input_gives_clear_errors():
    params, cfg = dense_params(), DENSE
    ctx = cfg.max_position_embeddings
    with pytest.raises(ValueError, match="exceeds the model's context"):
        generate(params, cfg, [[1] * (ctx - 2)], max_new_tokens=8)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        generate(params, cfg, [[1] * (ctx + 1)], max_new_tokens=1)
    # A prompt that fits is not pushed out of the context by bucketing: 300 tokens
    # would bucket to 512 slots, capped here at 512 - 8 for 8 new tokens.
    assert pad_prompts([[1] * 300], 0, max_len=ctx - 8)[0].shape == (1, ctx - 8)
    assert pad_prompts([[1] * 5], 0, max_len=ctx - 8)[0].shape == (1, 8)
    with pytest.raises(ValueError, match="empty prompt at index 1"):
        generate(params, cfg, [[1, 2], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="no prompts"):
        generate(params, cfg, [], max_new_tokens=4)
    for top_p in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
            SamplingConfig(top_p=top_p)
    for t in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature must be > 0.*use greedy=True"):
            SamplingConfig(temperature=t)
        with pytest.raises(ValueError, match="temperature must be > 0.*records log-probs at it"):
            SamplingConfig(greedy=True, temperature=t)
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        SamplingConfig(top_k=-1)
    for n in (0, -3):
        with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
            generate(params, cfg, [[1, 2]], max_new_tokens=n)
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        generate(params, cfg, [[1, 2]], num_samples=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(params, cfg, [[1, cfg.vocab_size]], max_new_tokens=4)
    with pytest.raises(ValueError, match="needs a PRNG key"):
        generate(params, cfg, [[1, 2]], sampling=SamplingConfig(temperature=1.0))
    with pytest.raises(ValueError, match="compute_mode"):
        LoopSpec("full", "lazy")
    with pytest.raises(ValueError, match="bad exit rule"):
        LoopSpec("sometimes")
