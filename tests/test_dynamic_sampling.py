"""Dynamic sampling's refill (`rl.dynamic_sampling.refill_groups`) and the concatenation of
the rounds' rollouts (`rollout.generate.concat_rollouts`)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_lp.numerics.policy import FP32, Policy
from jaxrl_lp.rl.advantages import zero_variance_groups
from jaxrl_lp.rl.dynamic_sampling import refill_groups
from jaxrl_lp.rollout.generate import Rollout, concat_rollouts, take_rows

G, P = 2, 3
LIVE, DEAD = [1.0, 0.0], [1.0, 1.0]  # one informative and one zero-variance group of G = 2


def _round(*groups):
    return np.array([r for g in groups for r in g], np.float32)


class _Draws:
    """`draw` over fixed rounds, recording which rounds were asked for."""

    def __init__(self, rounds):
        self.rounds, self.asked = rounds, []

    def __call__(self, r):
        self.asked.append(r)
        return self.rounds[r]


def test_a_full_first_round_is_the_batch_and_nothing_more_is_drawn():
    draw = _Draws([_round(LIVE, LIVE, LIVE)])
    b = refill_groups(draw, P, G, max_rounds=4)
    assert draw.asked == [0] and b.single_round
    assert [r.tolist() for r in b.rows] == [[0, 1, 2, 3, 4, 5]]
    assert (b.refill_rounds, b.refilled_groups, b.zero_variance_groups, b.masked_groups) == \
        (0, 0, 0, 0)


def test_refill_stops_once_the_batch_is_informative_and_takes_only_what_is_missing():
    draw = _Draws([_round(DEAD, LIVE, DEAD), _round(DEAD, DEAD, DEAD),
                   _round(LIVE, DEAD, LIVE), _round(LIVE, LIVE, LIVE)])
    b = refill_groups(draw, P, G, max_rounds=5)
    # Round 0 has 1 of 3, round 1 none, round 2 the 2 missing: round 3 is never drawn.
    assert draw.asked == [0, 1, 2]
    assert [r.tolist() for r in b.rows] == [[2, 3], [], [0, 1, 4, 5]]
    assert not b.masked_B.any() and b.masked_B.shape == (P * G,)
    assert (b.refill_rounds, b.refilled_groups, b.zero_variance_groups, b.masked_groups) == \
        (2, 2, 6, 0)
    assert not b.single_round


def test_a_refill_round_gives_no_more_groups_than_are_missing():
    draw = _Draws([_round(LIVE, DEAD, DEAD), _round(LIVE, LIVE, LIVE)])
    b = refill_groups(draw, P, G, max_rounds=1)
    assert [r.tolist() for r in b.rows] == [[0, 1], [0, 1, 2, 3]]
    assert (b.refill_rounds, b.refilled_groups, b.masked_groups) == (1, 2, 0)


def test_at_the_bound_the_first_rounds_zero_variance_groups_complete_the_batch_masked():
    draw = _Draws([_round(DEAD, LIVE, DEAD), _round(DEAD, DEAD, DEAD), _round(DEAD, DEAD, LIVE),
                   _round(LIVE, LIVE, LIVE)])
    b = refill_groups(draw, P, G, max_rounds=2)
    assert draw.asked == [0, 1, 2]  # the bound: round 3 is not drawn
    # Round 0 keeps its informative group 1 and its first zero-variance group 0 (masked);
    # round 2 gives its informative group 2.
    assert [r.tolist() for r in b.rows] == [[0, 1, 2, 3], [], [4, 5]]
    assert b.masked_B.tolist() == [True, True, False, False, False, False]
    assert (b.refill_rounds, b.refilled_groups, b.zero_variance_groups, b.masked_groups) == \
        (2, 1, 7, 1)


def test_no_refill_rounds_is_masking_the_first_rounds_zero_variance_groups():
    """max_rounds=0: the batch of dynamic sampling before the refill (mask, do not refill)."""
    rewards = _round(DEAD, LIVE, DEAD)
    b = refill_groups(_Draws([rewards]), P, G, max_rounds=0)
    assert [r.tolist() for r in b.rows] == [list(range(P * G))]
    old = np.repeat(np.asarray(zero_variance_groups(jnp.asarray(rewards), G)), G)
    assert b.masked_B.tolist() == old.tolist()
    assert (b.refill_rounds, b.masked_groups) == (0, 2)


def test_the_batch_is_the_first_informative_groups_in_the_order_drawn():
    """Against a reference written over the flat stream of drawn groups."""
    rs = np.random.RandomState(0)
    for _ in range(200):
        rounds = [rs.randint(0, 2, P * G).astype(np.float32) for _ in range(5)]
        b = refill_groups(_Draws(rounds), P, G, max_rounds=4)
        stream = [(r, g) for r in range(len(b.rows)) for g in range(P)]
        live = [(r, g) for r, g in stream if rounds[r][g * G:(g + 1) * G].std() > 0]
        got = [(r, int(i) // G) for r, rows in enumerate(b.rows) for i in rows[::G]]
        masked = [rg for rg, m in zip(got, b.masked_B[::G], strict=True) if m]
        assert [rg for rg in got if rg not in masked] == live[:P]
        assert len(got) == P and b.masked_groups == len(masked) == P - len(live[:P])
        assert b.zero_variance_groups == len(stream) - len(live)
        if b.masked_groups:  # the bound was hit, and round 0's first dead groups fill in
            dead0 = [(0, g) for g in range(P) if (0, g) not in live]
            assert b.refill_rounds == 4 and masked == dead0[:b.masked_groups]
        else:
            assert b.refill_rounds == len(b.rows) - 1 and b.rows[-1].size > 0


def test_bad_rounds_and_bounds_are_refused():
    with pytest.raises(ValueError, match="max_rounds must be >= 0"):
        refill_groups(_Draws([_round(LIVE, LIVE, LIVE)]), P, G, max_rounds=-1)
    with pytest.raises(ValueError, match=r"round 0 drew rewards of shape \(4,\); expected \(6,\)"):
        refill_groups(_Draws([_round(LIVE, LIVE)]), P, G, max_rounds=1)


def _rollout(rows, width, seed, digest=(1, 2), version=3, policy=FP32, layout="as_stored"):
    rs = np.random.RandomState(seed)
    n = 5
    lengths = rs.randint(1, width + 1, rows).astype(np.int32)
    prompt = np.full((rows, width), 0, np.int32)
    for b, k in enumerate(lengths):
        prompt[b, width - k:] = rs.randint(3, 9, k)
    return Rollout(
        prompt_tokens=jnp.asarray(prompt), prompt_lengths=jnp.asarray(lengths),
        completion_tokens=jnp.asarray(rs.randint(3, 9, (rows, n)), jnp.int32),
        completion_mask=jnp.asarray(rs.randint(0, 2, (rows, n)), jnp.float32),
        logprobs=jnp.asarray(-rs.rand(rows, n), jnp.float32),
        exit_steps=jnp.asarray(rs.randint(0, 2, (rows, n)), jnp.int32),
        loop_evals=jnp.int32(7 * seed), weights_version=jnp.int32(version), policy=policy,
        weights_digest=jnp.asarray(digest, jnp.uint32), decode_layout=layout)


def test_concat_rollouts_keeps_each_rows_values_and_pads_prompts_on_the_left():
    a, b = _rollout(4, 8, 1), _rollout(2, 16, 2)
    ro = concat_rollouts([take_rows(a, np.array([2, 3])), b], pad_id=0)
    assert ro.prompt_tokens.shape == (4, 16) and ro.logprobs.shape == (4, 5)
    np.testing.assert_array_equal(ro.prompt_tokens[:2, 8:], a.prompt_tokens[2:])
    np.testing.assert_array_equal(ro.prompt_tokens[:2, :8], 0)
    np.testing.assert_array_equal(ro.prompt_tokens[2:], b.prompt_tokens)
    for f in ("prompt_lengths", "completion_tokens", "completion_mask", "logprobs", "exit_steps"):
        np.testing.assert_array_equal(getattr(ro, f)[:2], getattr(a, f)[2:])
        np.testing.assert_array_equal(getattr(ro, f)[2:], getattr(b, f))
    # The recorded log-probs are the sampler's bits, row for row.
    assert (np.asarray(ro.logprobs).view(np.uint32)[2:] == np.asarray(b.logprobs)
            .view(np.uint32)).all()
    assert int(ro.loop_evals) == 7 + 14 and int(ro.weights_version) == 3
    np.testing.assert_array_equal(ro.weights_digest, a.weights_digest)
    assert concat_rollouts([a], pad_id=0) is a


@pytest.mark.parametrize("other, message", [
    (dict(digest=(1, 3)), "different weights"), (dict(version=4), "weights versions"),
    (dict(policy=Policy.parse("bf16")), "different policy"),
    (dict(layout="transposed"), "different decode_layout")])
def test_concat_rollouts_refuses_rollouts_of_other_weights_or_numerics(other, message):
    with pytest.raises(ValueError, match=message):
        concat_rollouts([_rollout(2, 8, 1), _rollout(2, 8, 2, **other)], pad_id=0)
    wide = _rollout(2, 8, 2)
    wide = dataclasses.replace(wide, completion_tokens=wide.completion_tokens[:, :4])
    with pytest.raises(ValueError, match="completion widths"):
        concat_rollouts([_rollout(2, 8, 1), wide], pad_id=0)
    with pytest.raises(ValueError, match="no rollouts"):
        concat_rollouts([], pad_id=0)
