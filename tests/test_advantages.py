"""Tests of group advantages, dynamic sampling and overlong shaping."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_lp.rl.advantages import (
    ADVANTAGE_KINDS,
    group_advantages,
    overlong_penalty,
    select_groups,
    turn_advantages,
    zero_variance_groups,
)

# Two groups of G = 4: one informative, one with all rewards equal.
REWARDS = [1.0, 0.0, 0.0, 0.5, 2.0, 2.0, 2.0, 2.0]
G = 4
TOL = 1e-6


def _jitted(kind):
    return jax.jit(functools.partial(group_advantages, group_size=G, kind=kind))


def _hand(kind):
    """The advantages of REWARDS written out with plain Python floats."""
    out = []
    for p in range(len(REWARDS) // G):
        r = REWARDS[p * G : (p + 1) * G]
        mean = sum(r) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / G)  # population std
        for g, x in enumerate(r):
            if kind == "grpo":
                out.append((x - mean) / (std + 1e-6))
            elif kind == "drgrpo":
                out.append(x - mean)
            else:
                others = [y for h, y in enumerate(r) if h != g]
                out.append(x - sum(others) / (G - 1))
    return out


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo"])
def test_group_advantages_match_hand_values(kind):
    adv_B = _jitted(kind)(jnp.array(REWARDS, jnp.float32))
    assert adv_B.dtype == jnp.float32 and adv_B.shape == (8,)
    np.testing.assert_allclose(np.asarray(adv_B), _hand(kind), rtol=TOL, atol=TOL)
    # The all-equal group gets exactly zero advantage whatever the kind.
    assert np.all(np.asarray(adv_B[4:]) == 0.0)


def test_grpo_first_group_written_out():
    # mean = 0.375; deviations 0.625, -0.375, -0.375, 0.125;
    # population variance = (0.390625 + 2 * 0.140625 + 0.015625) / 4 = 0.171875.
    std = math.sqrt(0.171875)
    adv_B = group_advantages(jnp.array(REWARDS), G, "grpo")
    expected = [0.625 / std, -0.375 / std, -0.375 / std, 0.125 / std]
    np.testing.assert_allclose(np.asarray(adv_B[:4]), expected, rtol=1e-5)


def test_rloo_is_scaled_drgrpo():
    r_B = jax.random.normal(jax.random.key(0), (12,))
    rloo = group_advantages(r_B, 3, "rloo")
    dr = group_advantages(r_B, 3, "drgrpo")
    np.testing.assert_allclose(np.asarray(rloo), 1.5 * np.asarray(dr), rtol=TOL, atol=TOL)


def test_bf16_rewards_give_f32():
    adv_B = group_advantages(jnp.array(REWARDS, jnp.bfloat16), G, "grpo")
    assert adv_B.dtype == jnp.float32


def test_group_size_one_raises():
    with pytest.raises(ValueError, match="a group size of 1"):
        group_advantages(jnp.zeros(4), 1)


def test_bad_grouping_raises():
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(jnp.zeros(6), 4)
    with pytest.raises(ValueError, match="kind"):
        group_advantages(jnp.zeros(4), 2, "ppo")


def test_zero_variance_groups_and_select():
    r_B = np.array([1, 1, 0, 1, 0, 0, 1, 0, 1, 1], np.float32)  # G = 2: 5 groups
    zero_P = np.asarray(jax.jit(zero_variance_groups, static_argnums=1)(r_B, 2))
    np.testing.assert_array_equal(zero_P, [True, False, True, False, True])
    np.testing.assert_array_equal(select_groups(r_B, 2), [2, 3, 6, 7])
    np.testing.assert_array_equal(select_groups(r_B, 2, max_groups=1), [2, 3])
    assert select_groups(r_B, 2, max_groups=0).shape == (0,)


def test_overlong_penalty_ramp():
    lengths_B = jnp.array([10, 80, 90, 95, 100, 130])
    pen_B = overlong_penalty(lengths_B, max_len=100, buffer=20, penalty_factor=0.5)
    expected = [0.0, 0.0, -0.25, -0.375, -0.5, -0.5]
    assert pen_B.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(pen_B), expected, rtol=TOL, atol=TOL)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths_B, max_len=100, buffer=0, penalty_factor=1.0)


def _turn_reference(r_BxT, turns_B, g, kind, discount):
    """`turn_advantages` by loops in f64: the reward-to-go of each taken turn, normalized over
    the group's rows that took the same turn (0 where a row is alone there)."""
    r_BxT = np.asarray(r_BxT, np.float64)
    b, t = r_BxT.shape
    ret = np.zeros_like(r_BxT)
    for i in range(b):
        for k in range(t):
            ret[i, k] = sum(discount ** (j - k) * r_BxT[i, j] for j in range(k, t))
    out = np.zeros_like(ret)
    for start in range(0, b, g):
        for k in range(t):
            rows = [i for i in range(start, start + g) if k < turns_B[i]]
            if len(rows) < 2:
                continue
            vals = ret[rows, k]
            centred = vals - vals.mean()
            if kind == "grpo":
                adv = centred / (vals.std() + 1e-6)
            elif kind == "drgrpo":
                adv = centred
            else:
                adv = centred * len(rows) / (len(rows) - 1)
            out[rows, k] = adv
    return out


@pytest.mark.parametrize("kind", ADVANTAGE_KINDS)
def test_turn_advantages_match_the_loop_reference(kind):
    """Ragged episodes (1 to 3 turns), rewards at several turns, discount 0.8: every taken
    turn's advantage is its reward-to-go against the group's rows at that turn; untaken turns
    and a turn one row alone reached are 0."""
    rng = np.random.default_rng(3)
    turns = np.array([3, 1, 2, 3, 1, 1, 2, 3])
    r = np.where(np.arange(3)[None] < turns[:, None], rng.integers(0, 3, (8, 3)) * 0.5, 0.0)
    got = np.asarray(turn_advantages(r.astype(np.float32), turns, 4, kind, discount=0.8))
    np.testing.assert_allclose(got, _turn_reference(r, turns, 4, kind, 0.8), atol=2e-6)
    assert (got[np.arange(3)[None] >= turns[:, None]] == 0).all()
    # Group 2 (rows 4-7): turn 2 was reached by row 7 alone.
    assert got[7, 2] == 0.0 and _turn_reference(r, turns, 4, kind, 0.8)[7, 1] != 0


@pytest.mark.parametrize("kind", ADVANTAGE_KINDS)
def test_turn_advantages_reduce_to_the_episodes(kind):
    """One reward per episode at its last turn, discount 1: the first turn's advantages are
    `group_advantages` of the episode rewards bit for bit (and one-turn episodes entirely)."""
    rng = np.random.default_rng(4)
    turns = rng.integers(1, 4, 8)
    final = rng.integers(0, 2, 8).astype(np.float32)
    r = np.zeros((8, 3), np.float32)
    r[np.arange(8), turns - 1] = final
    want = np.asarray(group_advantages(jnp.asarray(final), 4, kind))
    got = np.asarray(turn_advantages(r, turns, 4, kind))
    np.testing.assert_array_equal(got[:, 0], want)
    one = np.asarray(turn_advantages(final[:, None], np.ones(8, int), 4, kind))
    np.testing.assert_array_equal(one[:, 0], want)


def test_turn_advantages_refuse_a_discount_outside_0_1():
    with pytest.raises(ValueError, match="discount must be in"):
        turn_advantages(np.zeros((4, 2), np.float32), np.ones(4, int), 4, discount=1.5)
