"""From rewards to advantages: group baselines, dynamic sampling, overlong shaping.

Shapes: `B` sequences (rollouts) laid out in groups of `G` consecutive rows that
share a prompt, so row `i * G + g` is sample `g` of prompt `i`; `P = B / G`
prompts.

- `group_advantages`: the critic-free baselines of GRPO, Dr. GRPO and RLOO.
- `turn_advantages`: the same per model turn of multi-turn episodes (the
  reward-to-go from each turn, baselined by the group's rows at that turn).
- `zero_variance_groups` / `select_groups`: DAPO's dynamic sampling, which
  drops groups whose rewards are all equal (their advantages are all zero, so
  they carry no gradient) and refills the batch from further rollouts (the
  refill loop the training program runs is `rl.dynamic_sampling.refill_groups`).
- `overlong_penalty`: DAPO's soft overlong punishment, counted in tokens.

All outputs are f32. `group_advantages`, `zero_variance_groups` and
`overlong_penalty` are jit-friendly (`group_size`, `kind`, `max_len`, `buffer`
and `penalty_factor` are Python values: static under jit); `select_groups` is
a host-side numpy helper because its output length depends on the data.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ADVANTAGE_KINDS",
    "group_advantages",
    "overlong_penalty",
    "select_groups",
    "turn_advantages",
    "zero_variance_groups",
]

AdvantageKind = Literal["grpo", "drgrpo", "rloo"]
ADVANTAGE_KINDS: tuple[str, ...] = ("grpo", "drgrpo", "rloo")


def _check_groups(num_rows: int, group_size: int) -> None:
    if not isinstance(group_size, int | np.integer) or group_size < 2:
        raise ValueError(
            f"group_size must be an int >= 2, got {group_size!r}: a group size of 1 "
            "gives no signal (every advantage is zero, or undefined for rloo)"
        )
    if num_rows % group_size:
        raise ValueError(
            f"the number of rows ({num_rows}) must be a multiple of group_size "
            f"({group_size}); rows are grouped consecutively (row i * G + g)"
        )


def group_advantages(
    rewards_B: jax.Array,
    group_size: int,
    kind: AdvantageKind = "grpo",
    eps: float = 1e-6,
) -> jax.Array:
    """Per-sequence advantages from rewards with a per-group baseline.

    With `r_g`, `g = 0..G-1`, the rewards of one group, `mean = sum_g r_g / G`
    and the *population* standard deviation `std = sqrt(sum_g (r_g - mean)^2 / G)`
    (ddof 0, as `jnp.std`; verl uses the unbiased ddof-1 estimate, which is
    `sqrt(G / (G - 1))` times larger):

    - `grpo`:   `A_g = (r_g - mean) / (std + eps)`           (Shao et al., 2024)
    - `drgrpo`: `A_g = r_g - mean`                           (Liu et al., 2025)
    - `rloo`:   `A_g = r_g - sum_{h != g} r_h / (G - 1)`
                `    = G / (G - 1) * (r_g - mean)`          (Ahmadian et al., 2024)

    Args:
      rewards_B: [B] rewards, any float dtype (computed in f32).
      group_size: `G >= 2`; `B` must be a multiple of `G`.
      kind: one of `ADVANTAGE_KINDS`.
      eps: added to `std` for `grpo`, so a zero-variance group gives zeros.

    Returns:
      [B] f32 advantages, one per sequence, in the row order of `rewards_B`.

    Raises:
      ValueError: for `group_size < 2`, `B % group_size != 0` or an unknown
        `kind`.

    Examples:
      >>> group_advantages(jnp.array([1.0, 0.0, 0.0, 0.0]), 4, "drgrpo")
      Array([ 0.75, -0.25, -0.25, -0.25], dtype=float32)
    """
    if kind not in ADVANTAGE_KINDS:
        raise ValueError(f"kind must be one of {ADVANTAGE_KINDS}, got {kind!r}")
    (num_rows,) = rewards_B.shape
    _check_groups(num_rows, group_size)
    # Upcast: advantages are computed in f32 whatever the reward dtype.
    r_PxG = rewards_B.astype(jnp.float32).reshape(num_rows // group_size, group_size)
    mean_Px1 = jnp.mean(r_PxG, axis=1, keepdims=True)
    centred_PxG = r_PxG - mean_Px1
    if kind == "grpo":
        std_Px1 = jnp.sqrt(jnp.mean(jnp.square(centred_PxG), axis=1, keepdims=True))
        adv_PxG = centred_PxG / (std_Px1 + eps)
    elif kind == "drgrpo":
        adv_PxG = centred_PxG
    else:
        # Leave-one-out mean: (sum - r_g) / (G - 1); written as G/(G-1) * (r - mean)
        # so that equal rewards give exactly zero.
        adv_PxG = centred_PxG * (group_size / (group_size - 1))
    return adv_PxG.reshape(num_rows)


def turn_advantages(
    turn_rewards_BxT: jax.Array,
    turns_B: jax.Array,
    group_size: int,
    kind: AdvantageKind = "grpo",
    discount: float = 1.0,
    eps: float = 1e-6,
) -> jax.Array:
    """Per-turn advantages of multi-turn episodes: the return from each turn on, with a
    baseline from the group's episodes that reached the same turn.

    Row i's return from model turn t is the discounted reward-to-go
    `R_it = sum_{t' >= t} discount^(t' - t) r_it'` (its turn rewards from t on;
    a turn's reward is what the environment gave for that turn). Turn t's
    advantage normalizes `R_it` over the rows of the group that reached turn t
    (`t < turns_i`), by `kind` as `group_advantages` does over a whole group:
    `grpo` `(R - mean) / (std + eps)`, `drgrpo` `R - mean`, `rloo`
    `n / (n - 1) * (R - mean)` with n the rows that reached it (0 where n = 1).
    Where every row of the group reached turn t (turn 0 always) the values are
    `group_advantages` of that turn's returns, bit for bit: with discount 1 and
    one reward per episode the first turn's advantages are the episode-level
    ones. A turn a row alone reached has advantage 0 (no peer to compare with).

    Args:
      turn_rewards_BxT: [B, T] each row's reward per model turn (0 after its last).
      turns_B: [B] int model turns each row took (1..T).
      group_size: `G >= 2`; `B` must be a multiple of `G`.
      kind: one of `ADVANTAGE_KINDS`.
      discount: in [0, 1], the weight of a later turn's reward per turn.
      eps: added to `std` for `grpo`.

    Returns:
      [B, T] f32, 0 at the turns a row did not take.

    Raises:
      ValueError: as `group_advantages`; a discount outside [0, 1].
    """
    if kind not in ADVANTAGE_KINDS:
        raise ValueError(f"kind must be one of {ADVANTAGE_KINDS}, got {kind!r}")
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {discount!r}")
    b, t = turn_rewards_BxT.shape
    _check_groups(b, group_size)
    r_BxT = jnp.asarray(turn_rewards_BxT, jnp.float32)
    reached_BxT = jnp.arange(t)[None] < jnp.asarray(turns_B)[:, None]
    returns, later = [], jnp.zeros((b,), jnp.float32)
    for k in reversed(range(t)):  # R_t = r_t + discount * R_{t+1}
        later = r_BxT[:, k] + discount * later
        returns.append(later)
    returns_BxT = jnp.stack(returns[::-1], axis=1)
    p = b // group_size
    out = []
    for k in range(t):
        ret_PxG = returns_BxT[:, k].reshape(p, group_size)
        m_PxG = reached_BxT[:, k].reshape(p, group_size).astype(jnp.float32)
        n_Px1 = jnp.sum(m_PxG, axis=1, keepdims=True)
        mean_Px1 = jnp.sum(ret_PxG * m_PxG, axis=1, keepdims=True) / jnp.maximum(n_Px1, 1.0)
        centred_PxG = (ret_PxG - mean_Px1) * m_PxG
        if kind == "grpo":
            std_Px1 = jnp.sqrt(jnp.sum(jnp.square(centred_PxG), axis=1, keepdims=True)
                               / jnp.maximum(n_Px1, 1.0))
            part_PxG = centred_PxG / (std_Px1 + eps)
        elif kind == "drgrpo":
            part_PxG = centred_PxG
        else:
            part_PxG = jnp.where(n_Px1 > 1, centred_PxG * n_Px1 / jnp.maximum(n_Px1 - 1, 1.0),
                                 0.0)
        whole_PxG = group_advantages(returns_BxT[:, k], group_size, kind, eps).reshape(
            p, group_size)
        adv_PxG = jnp.where(m_PxG > 0, jnp.where(n_Px1 == group_size, whole_PxG, part_PxG),
                            0.0)
        out.append(adv_PxG.reshape(b))
    return jnp.stack(out, axis=1)


def zero_variance_groups(rewards_B: jax.Array, group_size: int) -> jax.Array:
    """Which groups have all rewards equal (and hence all advantages zero).

    Args:
      rewards_B: [B] rewards (numpy or jax), rows grouped consecutively.
      group_size: `G >= 2`, dividing `B`.

    Returns:
      [B / G] bool, True where every reward of the group is the same (exact
      equality: rewards are usually 0/1 verifier scores).
    """
    (num_rows,) = rewards_B.shape
    _check_groups(num_rows, group_size)
    r_PxG = jnp.asarray(rewards_B, jnp.float32).reshape(num_rows // group_size, group_size)
    return jnp.max(r_PxG, axis=1) == jnp.min(r_PxG, axis=1)


def select_groups(
    rewards_B: np.ndarray, group_size: int, max_groups: int | None = None
) -> np.ndarray:
    """Row indices of the informative groups, for DAPO dynamic sampling (host side).

    Dynamic sampling keeps only the groups whose rewards differ and refills the
    batch by sampling more prompts. The refill loop, with `P` prompts wanted
    (`rl.dynamic_sampling.refill_groups` is this loop, bounded):

        rows = []                                   # kept rollouts
        while len(rows) < P * G:
            batch = rollout(next prompts)           # rewards_B of the new batch
            idx = select_groups(batch.rewards_B, G, P - len(rows) // G)
            rows += [batch[i] for i in idx]

    Args:
      rewards_B: [B] rewards (converted to a host numpy array).
      group_size: `G >= 2`, dividing `B`.
      max_groups: keep at most this many groups (the first ones, in order);
        None keeps all informative groups.

    Returns:
      int32 row indices, ascending, of whole groups (`k * G` of them for `k`
      kept groups), each group's `G` rows consecutive.
    """
    rewards_B = np.asarray(rewards_B)
    keep_P = ~np.asarray(zero_variance_groups(rewards_B, group_size))
    groups = np.flatnonzero(keep_P)
    if max_groups is not None:
        if max_groups < 0:
            raise ValueError(f"max_groups must be >= 0 or None, got {max_groups}")
        groups = groups[:max_groups]
    rows = groups[:, None] * group_size + np.arange(group_size)[None, :]
    return rows.reshape(-1).astype(np.int32)


def overlong_penalty(
    lengths_B: jax.Array, max_len: int, buffer: int, penalty_factor: float = 1.0
) -> jax.Array:
    """DAPO soft overlong punishment, in tokens, to add to the reward.

    With `L` the completion length in tokens, `L_max = max_len` and
    `L_c = buffer`:

        penalty(L) = 0                                    if L <= L_max - L_c
                   = -penalty_factor * (L - (L_max - L_c)) / L_c
                                                          if L_max - L_c < L <= L_max
                   = -penalty_factor                      if L > L_max

    so it falls linearly from 0 to `-penalty_factor` over the last `buffer`
    tokens (Yu et al., 2025, eq. 13, scaled by `penalty_factor`).

    Args:
      lengths_B: [B] completion lengths in tokens (int or float).
      max_len: `L_max`, the generation budget in tokens.
      buffer: `L_c`, the length of the linear ramp, `0 < buffer <= max_len`.
      penalty_factor: the penalty at `max_len` (>= 0).

    Returns:
      [B] f32 penalties (<= 0).
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"buffer must be in (0, max_len={max_len}], got {buffer}")
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    # Upcast: lengths are integers; the ramp is fractional.
    length_B = jnp.asarray(lengths_B).astype(jnp.float32)
    over_B = jnp.clip((length_B - (max_len - buffer)) / buffer, 0.0, 1.0)
    return -penalty_factor * over_B
