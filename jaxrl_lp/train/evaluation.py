"""Greedy held-out accuracy: of parameters in hand, and of a run's checkpoint (`jaxrl-lp eval`)."""

from __future__ import annotations

import numpy as np

from jaxrl_lp.parallel.shard import to_host
from jaxrl_lp.rollout.generate import generate
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.rollout.step import LoopSpec
from jaxrl_lp.train.checkpoint import Checkpointer
from jaxrl_lp.train.config import TrainConfig
from jaxrl_lp.train.episodes import evaluate_episodes, is_multiturn
from jaxrl_lp.train.lora_run import read_lora_params
from jaxrl_lp.train.validate import build_task, model_config

__all__ = ["evaluate", "evaluate_run"]


def evaluate(params, mcfg, task, policy, loop, size: int, max_new: int, mesh=None) -> float:
    """Greedy held-out accuracy on the first `size` held-out problems (deterministic).

    A multi-turn task's problems are greedy episodes (`train.episodes.evaluate_episodes`;
    `max_new` unused, the task's turn limits apply).

    With `mesh` the sampler runs sharded (`generate(mesh=...)`) and every
    process scores the whole batch.
    """
    if is_multiturn(task):  # greedy episodes: solved when the reward reaches 1
        return evaluate_episodes(params, mcfg, task, policy, loop, size)["accuracy"]
    problems = [task.heldout[i] for i in range(min(size, len(task.heldout)))]
    tok = task.tokenizer
    ro = generate(params, mcfg, [task.prompt_ids(p) for p in problems], policy=policy,
                  sampling=SamplingConfig(greedy=True), max_new_tokens=max_new,
                  eos_id=tok.eos_id, pad_id=tok.pad_id, loop=loop, mesh=mesh)
    return float(np.mean(task.rewards(to_host(ro.completion_tokens), problems)))


def evaluate_run(cfg: TrainConfig, size: int | None = None, *, step: int | None = None,
                 served: bool = False, exporter: str | None = None) -> dict:
    """Greedy held-out accuracy of a checkpoint of the run in `cfg.run.out_dir`.

    Only the params are restored (and, with `served`, the exporter state), so a
    run evaluates whatever its sync settings and phase: with or without a
    `sync.exporter`, a warm-start or a finished run.

    Args:
      cfg: the run's config (`run.out_dir` names the run; the model must match
        the checkpoint's).
      size: held-out problems scored (default `run.eval_size`).
      step: the checkpoint step (default: the latest).
      served: also score the served copy: the run's exporter applied to the
        params with the exporter state saved in the checkpoint, exactly what
        `run_train` reports as `final_accuracy_served`.
      exporter: score the copy this `sync.exporter` spec serves instead (from
        its initial state unless it is the run's own); implies `served`.

    Returns:
      `{"step", "accuracy"}`, plus `"accuracy_served"` and `"exporter"` with `served`.
    """
    from jaxrl_lp.lora import LoraWeights
    from jaxrl_lp.optim import OptimizerSpec
    from jaxrl_lp.sync.export import served_params_for_forward
    from jaxrl_lp.train.run_io import served_export

    ckpt = Checkpointer(cfg.run.out_dir, create=False)
    try:
        step = ckpt.resolve_step(step)
        task = build_task(cfg)
        mcfg = model_config(cfg, task)
        params, meta = ckpt.restore_params(step, mcfg)
        weights = OptimizerSpec.parse(cfg.sft.optimizer, "sft.optimizer").weights()
        if weights is not None:  # a low-bit run's train tree -> the model's params
            params = weights.materialize(params)
        params, lora = read_lora_params(cfg.run.out_dir, params, meta, mcfg, cfg.init_from)
        if lora is not None:  # the adapters on their (checked) base, as the sampler reads them
            params = LoraWeights(lora, mcfg).materialize(params)
        served = served or exporter is not None
        export = served_export(ckpt, params, meta, step, exporter) if served else None
    finally:
        ckpt.close()
    g = cfg.grpo
    loop = LoopSpec(g.exit_rule, g.compute_mode).resolve(mcfg)

    def score(p):
        return evaluate(p, mcfg, task, g.policies.sampler, loop,
                        size or cfg.run.eval_size, g.max_new_tokens or task.max_completion_tokens)

    out = {"step": step, "accuracy": score(params)}
    if export is not None:
        out["accuracy_served"] = score(served_params_for_forward(export[0]))
        out["exporter"] = export[1]["exporter"]
    return out
