"""The training program's state, named: what a run checkpoints and the counters it keeps.

`RunState` holds the device trees a run updates and checkpoints (params, both
optimizer states, the sync state); `Progress` holds the host-side counters
written into each checkpoint's metadata. Both are frozen: a step returns a new
value (`dataclasses.replace`) instead of changing one in place, so what a
function changes is in its signature.

A checkpoint stores `RunState.tree()`, a dict with the same four keys
(`params`, `opt_sft`, `opt_grpo`, `sync`), so checkpoints written before these
types existed restore unchanged. An off-policy run (`grpo.max_staleness > 0`)
adds a fifth, `sampler`: the sampler's weights its pending rollouts are
sampled on (`train.rollout_queue`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

__all__ = ["Progress", "RunState"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RunState:
    """The device state of a run: every tree a step updates and a checkpoint holds.

    With a low-bit `sft.optimizer`, `params` is the train tree of the run's
    weight representation (`optim.weights`), not the model's params.
    """

    params: Any      # the model's params (or the train tree of `plan.weights`)
    opt_sft: Any     # the warm-start optimizer's state
    opt_grpo: Any    # the GRPO optimizer's state
    sync: Any        # the exporter's state and diagnostics (`SyncHooks.init_state`)
    sampler: Any = None  # off-policy runs: the sampler's weights by version
                         # (`RolloutQueue.tree`); None: nothing in flight is kept

    def tree(self) -> dict:
        """The checkpointed dict: `{"params", "opt_sft", "opt_grpo", "sync"}`, and `"sampler"`
        where it is not None."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "sampler" or self.sampler is not None}

    @classmethod
    def from_tree(cls, tree: dict) -> RunState:
        """The state of a checkpointed dict (`tree()`'s inverse)."""
        return cls(**tree)


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where a run is, on the host: the counters a checkpoint's metadata carries."""

    step: int = 0                         # global steps done (warm-start, then GRPO)
    initial_accuracy: float | None = None  # held-out accuracy at the first GRPO step; None
                                          # before it (also: GRPO has not started)
    nonfinite_in_row: int = 0             # consecutive skipped (non-finite) steps
    skipped_total: int = 0                # skipped steps over the run
    metrics_records: int = 0              # metrics.jsonl records written up to `step`

    def meta(self) -> dict:
        """The counters as checkpoint metadata (JSON values)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_meta(cls, meta: dict) -> Progress:
        """The counters of a checkpoint's metadata (older ones lack `metrics_records`: 0)."""
        return cls(**{f.name: meta.get(f.name, f.default) for f in dataclasses.fields(cls)})

    def counted(self, skipped: bool) -> Progress:
        """After one more step, skipped (non-finite) or not."""
        return dataclasses.replace(
            self, step=self.step + 1,
            nonfinite_in_row=self.nonfinite_in_row + 1 if skipped else 0,
            skipped_total=self.skipped_total + int(skipped))
