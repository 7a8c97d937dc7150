"""The frozen KL reference's params of a run (`loss.kl_beta > 0`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxrl_lp.models.model import init_params
from jaxrl_lp.parallel import param_shardings
from jaxrl_lp.parallel.shard import put_tree
from jaxrl_lp.train.checkpoint import Checkpointer
from jaxrl_lp.train.config import TrainConfig
from jaxrl_lp.train.validate import RunPlan

__all__ = ["reference_params"]


def reference_params(cfg: TrainConfig, plan: RunPlan, run_dir: Path, start) -> dict:
    """The frozen KL reference's params (`loss.kl_beta > 0`), sharded like the model's.

    `loss.reference=PATH`: that Hugging Face checkpoint (`validate` checked its
    architecture and vocabulary). Otherwise the GRPO phase's starting weights:
    `start` (the model's params at the first GRPO step) is copied and written
    once to `<run_dir>/reference` (orbax, atomic), which a run resumed inside
    GRPO (`start=None`) reads back. Nothing is added to the run's checkpoints.
    """
    mcfg, mesh = plan.model, plan.mesh
    shardings = None if mesh is None else param_shardings(
        jax.eval_shape(lambda: init_params(mcfg, jax.random.PRNGKey(0))), mcfg, mesh)
    if cfg.loss.reference:
        from jaxrl_lp.models.hf_io import load_hf_params

        return load_hf_params(cfg.loss.reference, mcfg, shardings=shardings)
    store = Checkpointer(run_dir, keep=1, subdir="reference")
    try:
        step = cfg.sft.steps
        if start is not None and store.latest_step() != step:
            ref = jax.tree.map(jnp.copy, start)  # the learner step donates the master
            store.save(step, {"params": ref},
                       {"model": json.loads(json.dumps(dataclasses.asdict(mcfg)))})
            return ref
        if store.latest_step() != step:
            raise ValueError(
                f"loss.kl_beta={cfg.loss.kl_beta}: the run in {run_dir} is inside its GRPO phase "
                f"but has no KL reference ({store.dir}/{step}): it started GRPO with kl_beta = 0. "
                "Set loss.reference to a checkpoint directory, or start a new run.out_dir")
        params, _ = store.restore_params(step, mcfg)
    finally:
        store.close()
    return params if shardings is None else put_tree(params, shardings)
