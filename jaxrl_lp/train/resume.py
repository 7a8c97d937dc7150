"""Resuming a run: the newest intact checkpoint, restored with the sync settings it was saved with.

A damaged checkpoint (`DamagedCheckpointError`: a truncated array file, a
missing metadata file) is named on stderr, set aside as `<step>.damaged` and
the next older one is tried, so a run continues from its newest intact step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import jax

from jaxrl_lp.train.checkpoint import Checkpointer, DamagedCheckpointError
from jaxrl_lp.train.sync_hooks import SyncConfig, SyncHooks

__all__ = ["restore_newest_intact"]


def _warn(text: str) -> None:
    print(f"jaxrl-lp train: warning: {text}", file=sys.stderr)


def restore_newest_intact(ckpt: Checkpointer, state: dict | Callable[[dict], dict], cfg, mcfg,
                          hooks: SyncHooks, lpol, spol, warn: Callable[[str], None] = _warn
                          ) -> tuple[dict, dict] | None:
    """`(state, meta)` of the newest intact checkpoint, or None when there is none.

    `state` is the tree to restore into, or a function of a checkpoint's
    metadata that gives it (an off-policy run's pending weights).

    Damaged steps met on the way are set aside and reported through `warn`.

    Raises:
      ValueError: the newest intact checkpoint belongs to another model or
        cannot be continued with this config (see `restore_step`).
    """
    damaged = False
    for step in reversed(ckpt.steps()):
        try:
            return restore_step(ckpt, step, state, cfg, mcfg, hooks, lpol, spol)
        except DamagedCheckpointError as e:
            damaged = True
            if jax.process_index() == 0:  # one process renames; the others wait and re-list
                where = ckpt.set_aside(step)
                warn(f"{e}; set it aside as {where.name} and trying the checkpoint before it")
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices(f"jaxrl_lp_set_aside_{step}")
                ckpt.reload()
    if damaged:
        warn("no intact checkpoint is left: the run starts again from step 0")
    return None


def restore_step(ckpt: Checkpointer, step: int, state: dict, cfg, mcfg, hooks: SyncHooks, lpol,
                 spol) -> tuple[dict, dict]:
    """Checkpoint `step`, also when it was written with other sync settings.

    Before GRPO has started the exporter's state is still its initial state, so
    a warm-start can be resumed with another `sync.exporter` (its state is made
    afresh); once GRPO steps have used the saved exporter, resuming with another
    would not continue that run, and is refused.
    """
    if callable(state):  # the tree depends on what the checkpoint holds (`train.program`)
        state = state(ckpt.meta(step))
    saved = ckpt.meta(step).get("sync")
    if saved is None or saved.get("exporter") == cfg.sync.exporter:
        return ckpt.restore(state, mcfg, step)
    saved_hooks = SyncHooks(SyncConfig(**saved), mcfg, lpol, spol)
    restored, meta = ckpt.restore({**state, "sync": saved_hooks.init_state(state["params"])},
                                  mcfg, step)
    if meta["initial_accuracy"] is not None:
        raise ValueError(
            f"the run in {cfg.run.out_dir} has done GRPO steps with "
            f"sync.exporter={saved['exporter']}; resuming it with "
            f"sync.exporter={cfg.sync.exporter} would not continue that run. Resume with "
            f"--set sync.exporter={saved['exporter']}, or start the new exporter from a "
            "warm-start checkpoint (jaxrl-lp sft) in another run.out_dir")
    restored["sync"] = hooks.init_state(restored["params"])
    return restored, meta
