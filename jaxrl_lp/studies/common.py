"""Helpers the studies share: configs, restoring a run's state, re-seating a checkpoint.

The studies drive the training program (`jaxrl_lp.train.run_train`) and read
its run directories back. Two things the program does not offer as public API
live here:

- `restore_state(cfg)`: the full checkpointed state (params, optimizer states,
  sync state) of the latest checkpoint in `cfg.run.out_dir`, restored into the
  structure `cfg` implies.
- `reseat_checkpoint(src_cfg, dst_cfg)`: rewrites the latest checkpoint of
  `dst_cfg.run.out_dir` (a copy of `src_cfg`'s run) with the sync-state
  structure `dst_cfg` expects. A warm-start run with `sync.exporter=none`
  stores an empty sync state; resuming it with an exporter set fails in orbax
  because the tree structures differ. The sync state is re-initialised by
  `SyncHooks.start` at the first GRPO step anyway, so its content does not
  matter, only its structure.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.train.checkpoint import Checkpointer
from jaxrl_lp.train.config import TrainConfig, apply_overrides
from jaxrl_lp.train.defaults import default_config
from jaxrl_lp.train.sync_hooks import SyncHooks

__all__ = ["QUICK_OVERRIDES", "check_arms", "check_overrides", "make_config", "remove_outputs",
           "reseat_checkpoint", "restore_state"]

# A tiny model, task and batch for smoke runs (`--quick`, the tests). One-digit addition
# and 100 warm-start steps give the tiny model some reward variance (about 20% accuracy),
# without which GRPO does not move the master at all.
QUICK_OVERRIDES: tuple[str, ...] = (
    "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
    "model.head_dim=16", "model.intermediate_size=64", "model.loop_steps=2",
    "task.max_digits=1", "sft.steps=100", "sft.lr=1e-2", "sft.batch_size=16",
    "grpo.prompts_per_step=4", "grpo.group_size=4", "run.eval_size=32",
)


def make_config(overrides: list[str] | tuple[str, ...]) -> TrainConfig:
    """The default config (read at call time) with `a.b=c` overrides applied in order.

    A study measures the mismatch at every GRPO step: `grpo.verify_every=1`
    (a study's own overrides may change it), so where the learner takes the
    sampler's recorded log-probs (`grpo.replay=auto`) the batch is still
    replayed and compared, and the `mismatch_*` metrics are logged each step.
    """
    return apply_overrides(default_config(), ["grpo.verify_every=1", *overrides])


def check_overrides(study: str, overrides, owned) -> None:
    """A one-line ValueError for an override of a key the study sets itself (`owned`)."""
    for o in overrides:
        key = str(o).split("=", 1)[0].strip()
        if key in owned:
            raise ValueError(f"{study}: --set {key} is set by the study itself (its arms, "
                             f"--steps, --out); remove it")


def check_arms(study: str, arms, valid: tuple[str, ...], what: str = "arm") -> tuple[str, ...]:
    """`arms` as a tuple (None: `valid`); a one-line ValueError naming the valid ones."""
    if arms is None:
        return valid
    arms = tuple(arms)
    bad = [a for a in arms if a not in valid]
    if bad or not arms:
        raise ValueError(f"{study}: unknown {what}(s) {bad or '(none given)'}; "
                         f"{what}s are {','.join(valid)}")
    return arms


def remove_outputs(out: Path, names: list[str] | tuple[str, ...]) -> None:
    """Deletes the entries `names` (files or directories) of `out`, and nothing else."""
    for name in names:
        p = Path(out) / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


def _policies(cfg: TrainConfig) -> tuple[Policy, Policy]:
    return Policy.parse(cfg.grpo.learner_policy), Policy.parse(cfg.grpo.sampler_policy)


def restore_state(cfg: TrainConfig) -> tuple[dict, dict, Any, Any, SyncHooks]:
    """The latest checkpoint of `cfg.run.out_dir`.

    Returns:
      `(state, meta, task, model_config, hooks)`: `state` has the keys of the
      training program's state (`params`, `opt_sft`, `opt_grpo`, `sync`), `hooks`
      the `SyncHooks` for `cfg.sync`.
    """
    # The program's own builder, so the restored structure is exactly the one it saves.
    from jaxrl_lp.train.program import initial_state

    plan, like, hooks = initial_state(cfg)
    task, mcfg = plan.task, plan.model
    ckpt = Checkpointer(cfg.run.out_dir)
    try:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint in {cfg.run.out_dir}/checkpoints")
        state, meta = ckpt.restore(like.tree(), mcfg)
    finally:
        ckpt.close()
    return state, meta, task, mcfg, hooks


def reseat_checkpoint(src_cfg: TrainConfig, dst_cfg: TrainConfig) -> int:
    """Rewrites `dst_cfg.run.out_dir`'s latest checkpoint with `dst_cfg`'s sync-state structure.

    The checkpoint (a copy of a run made with `src_cfg`) is read with the
    structure `src_cfg` implies, from `dst_cfg.run.out_dir`; params,
    optimizer states and metadata are kept; the sync state becomes
    `SyncHooks(dst_cfg.sync).init_state(params)`. Returns the checkpoint step.
    """
    src_cfg = dataclasses.replace(
        src_cfg, run=dataclasses.replace(src_cfg.run, out_dir=dst_cfg.run.out_dir))
    state, meta, _, mcfg, _ = restore_state(src_cfg)
    lpol, spol = _policies(dst_cfg)
    state["sync"] = SyncHooks(dst_cfg.sync, mcfg, lpol, spol).init_state(state["params"])
    meta["sync"] = dataclasses.asdict(dst_cfg.sync)  # what the sync state now is
    step = int(meta["step"])
    shutil.rmtree(Path(dst_cfg.run.out_dir) / "checkpoints")
    ckpt = Checkpointer(dst_cfg.run.out_dir, keep=dst_cfg.run.keep_checkpoints)
    try:
        ckpt.save(step, state, meta)
    finally:
        ckpt.close()
    return step
