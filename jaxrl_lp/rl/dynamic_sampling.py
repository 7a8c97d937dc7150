"""DAPO dynamic sampling with refill: draw rounds of groups until the batch is informative.

A group whose rewards are all equal has all-zero advantages and carries no
gradient (`advantages.zero_variance_groups`). Dynamic sampling (Yu et al.,
2025, DAPO) drops such groups and samples further prompts until the batch
holds the asked number of informative groups. `refill_groups` is that loop,
on the host: it calls `draw(r)` for round `r = 0, 1, ...` (the caller samples
and scores a fresh batch of prompts there and keeps the rollout) and picks
which groups of which round make up the batch. At most `max_rounds` refill
rounds are drawn after the first; where the bound is hit, the batch is
completed with round 0's zero-variance groups, which the caller masks out of
the loss (the behaviour of dynamic sampling without refill).

Shapes: a round's rewards are `[B_r]`, groups of `G` consecutive rows (row
`i * G + g` is sample `g` of prompt `i`); `P` groups are wanted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxrl_lp.rl.advantages import zero_variance_groups

__all__ = ["RefilledBatch", "refill_groups"]


@dataclasses.dataclass(frozen=True)
class RefilledBatch:
    """Which groups of which rounds make up a dynamic-sampling batch.

    The batch is the rounds' picked rows concatenated in round order: round
    0's picked groups (ascending), then round 1's, and so on.

    Attributes:
      rows: one int32 array per round drawn: the row indices (whole groups,
        ascending) of that round taken into the batch; empty for a round none
        of whose groups was taken.
      masked_B: [P * G] bool, batch row order: rows of zero-variance groups kept
        only because the refill bound was hit (to be masked out of the loss).
      refill_rounds: rounds drawn after the first (0: the first round sufficed).
      zero_variance_groups: zero-variance groups among all the groups drawn.
      refilled_groups: informative groups the batch takes from refill rounds.
      masked_groups: zero-variance groups in the batch (the rows of `masked_B`):
        non-zero only where the refill bound was hit.
    """

    rows: tuple[np.ndarray, ...]
    masked_B: np.ndarray
    refill_rounds: int
    zero_variance_groups: int
    refilled_groups: int
    masked_groups: int

    @property
    def single_round(self) -> bool:
        """The batch is the first round as drawn: every one of its rows, none masked."""
        return len(self.rows) == 1 and not self.masked_B.any()


def _group_rows(groups: np.ndarray, group_size: int) -> np.ndarray:
    return (groups[:, None] * group_size + np.arange(group_size)).reshape(-1).astype(np.int32)


def refill_groups(draw: Callable[[int], np.ndarray], num_groups: int, group_size: int,
                  max_rounds: int) -> RefilledBatch:
    """Draws rounds until `num_groups` informative groups are found (at most `max_rounds` refills).

    Round 0 is always drawn. While fewer than `num_groups` informative groups
    have been found and fewer than `max_rounds` refill rounds drawn, round
    `r + 1` is drawn and its informative groups taken, in order, up to the
    number still missing. If the bound is hit, the batch is completed with
    round 0's first zero-variance groups (round 0 has at least as many as are
    missing, since every round draws `num_groups` groups): they are marked in
    `masked_B`. With `max_rounds = 0` the batch is round 0 with its
    zero-variance groups masked (dynamic sampling without refill).

    Args:
      draw: `draw(r) -> [num_groups * group_size]` rewards of round `r`
        (host values; the caller samples and scores the round there).
      num_groups: `P`, the informative groups wanted.
      group_size: `G >= 2`.
      max_rounds: refill rounds allowed after round 0, >= 0.

    Returns:
      A `RefilledBatch`.

    Raises:
      ValueError: a round's rewards are not `num_groups * group_size` values,
        or `max_rounds < 0`.

    Examples:
      >>> rounds = [np.array([1., 1., 0., 1.]), np.array([0., 0., 1., 0.])]
      >>> b = refill_groups(lambda r: rounds[r], 2, 2, max_rounds=3)
      >>> [r.tolist() for r in b.rows], b.refill_rounds, b.refilled_groups
      ([[2, 3], [2, 3]], 1, 1)
    """
    if max_rounds < 0:
        raise ValueError(f"max_rounds must be >= 0; got {max_rounds}")
    want = num_groups * group_size
    taken: list[np.ndarray] = []  # group indices taken from each round
    zero_var = 0
    first_dead = None
    found = 0
    r = 0
    while r == 0 or (found < num_groups and r <= max_rounds):
        rewards_B = np.asarray(draw(r))
        if rewards_B.shape != (want,):
            raise ValueError(f"round {r} drew rewards of shape {rewards_B.shape}; "
                             f"expected ({want},) = num_groups x group_size")
        dead_P = np.asarray(zero_variance_groups(rewards_B, group_size))
        zero_var += int(dead_P.sum())
        if r == 0:
            first_dead = np.flatnonzero(dead_P)
        live = np.flatnonzero(~dead_P)[: num_groups - found]
        taken.append(live)
        found += len(live)
        r += 1
    # The bound was hit: round 0's first zero-variance groups complete the batch, masked.
    fill = first_dead[: num_groups - found]
    groups0 = np.sort(np.concatenate([taken[0], fill]))
    masked0 = np.isin(groups0, fill)
    rows = (_group_rows(groups0, group_size),
            *(_group_rows(t, group_size) for t in taken[1:]))
    masked_B = np.concatenate([np.repeat(masked0, group_size),
                               np.zeros(sum(len(t) for t in taken[1:]) * group_size, bool)])
    return RefilledBatch(rows=rows, masked_B=masked_B, refill_rounds=r - 1,
                         zero_variance_groups=zero_var,
                         refilled_groups=int(sum(len(t) for t in taken[1:])),
                         masked_groups=len(fill))
