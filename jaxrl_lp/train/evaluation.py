"""Held-out scores, of parameters in hand and of a run's checkpoint (`jaxrl-lp eval`): greedy
accuracy, and mean@k and pass@k of sampled completions."""

from __future__ import annotations

import jax
import numpy as np

from jaxrl_lp.parallel.shard import to_host
from jaxrl_lp.rollout.generate import generate
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.rollout.step import LoopSpec
from jaxrl_lp.tasks.rewards import RewardBatch
from jaxrl_lp.train.checkpoint import Checkpointer
from jaxrl_lp.train.config import TrainConfig
from jaxrl_lp.train.episodes import evaluate_episodes, is_multiturn
from jaxrl_lp.train.lora_run import read_lora_params
from jaxrl_lp.train.validate import build_task, model_config

__all__ = ["SOLVED", "evaluate", "evaluate_run", "heldout_rewards", "pass_at_k", "sampled_scores"]

# A sample is solved (counts for accuracy, mean@k and pass@k) when its reward is at least this:
# the built-in tasks' rewards are 1 for a right answer; a task of one's own scales its rewards
# so (a format bonus on top of a right answer still counts as solved).
SOLVED = 1.0


def heldout_rewards(params, mcfg, task, policy, loop, records, max_new: int, *,
                    sampling: SamplingConfig, samples: int = 1, key=None,
                    mesh=None) -> np.ndarray:
    """[len(records), samples] f32 rewards of `samples` completions (or episodes, for a
    multi-turn task, under its turn limits) of each record, drawn with `sampling`."""
    key = jax.random.PRNGKey(0) if key is None else key
    if is_multiturn(task):
        from jaxrl_lp.envs import EnvRunner
        from jaxrl_lp.train.episodes import sample_episodes

        runner = EnvRunner()
        try:
            mt = sample_episodes(params, mcfg, task, records, group_size=samples, policy=policy,
                                 sampling=sampling, loop=loop, key=key, runner=runner)
        finally:
            runner.close()
        return np.asarray(mt.rewards, np.float32).reshape(len(records), samples)
    tok = task.tokenizer
    ro = generate(params, mcfg, [task.prompt_ids(p) for p in records], policy=policy,
                  sampling=sampling, max_new_tokens=max_new, num_samples=samples,
                  eos_id=tok.eos_id, pad_id=tok.pad_id, loop=loop, key=key, mesh=mesh)
    out = task.rewards(to_host(ro.completion_tokens), [p for p in records for _ in range(samples)])
    total = out.total_B if isinstance(out, RewardBatch) else out
    return np.asarray(total, np.float32).reshape(len(records), samples)


def evaluate(params, mcfg, task, policy, loop, size: int, max_new: int, mesh=None) -> float:
    """Greedy held-out accuracy on the first `size` held-out problems (deterministic): the
    share whose reward is at least `SOLVED`.

    A multi-turn task's problems are greedy episodes (`train.episodes.evaluate_episodes`;
    `max_new` unused, the task's turn limits apply).

    With `mesh` the sampler runs sharded (`generate(mesh=...)`) and every
    process scores the whole batch.
    """
    if is_multiturn(task):  # greedy episodes: solved when the reward reaches 1
        return evaluate_episodes(params, mcfg, task, policy, loop, size)["accuracy"]
    records = [task.heldout[i] for i in range(min(size, len(task.heldout)))]
    rewards = heldout_rewards(params, mcfg, task, policy, loop, records, max_new,
                              sampling=SamplingConfig(greedy=True), mesh=mesh)
    return float(np.mean(rewards >= SOLVED))


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a problem with `c` solved among `n` samples: the chance that
    k of them drawn without replacement hold a solved one, 1 - C(n-c, k) / C(n, k)
    (Chen et al. 2021).

    Examples:
      >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 4), pass_at_k(4, 0, 2)
      (0.25, 1.0, 0.0)
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be in [1, n={n}]")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def sampled_scores(rewards_PxS: np.ndarray) -> dict[str, float]:
    """mean@S (the solved share of every sample), pass@k for k = 1, 2, 4, ... and S, and the
    mean reward, of [P, S] rewards (S samples of each of P problems)."""
    solved = np.asarray(rewards_PxS) >= SOLVED
    n = solved.shape[1]
    ks = sorted({k for k in (2**i for i in range(n.bit_length())) if k <= n} | {n})
    out = {f"mean@{n}": float(solved.mean()), "reward_mean": float(np.mean(rewards_PxS))}
    for k in ks:
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in solved.sum(1)]))
    return out


def evaluate_run(cfg: TrainConfig, size: int | None = None, *, step: int | None = None,
                 served: bool = False, exporter: str | None = None, task=None,
                 samples: int = 0, temperature: float = 1.0) -> dict:
    """Greedy held-out accuracy of a checkpoint of the run in `cfg.run.out_dir`, and with
    `samples` its mean@k and pass@k.

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
      task: the run's task object (None: `cfg.task`'s); checked against the run's
        `task.json` fingerprint.
      samples: also draw this many completions of each held-out problem at
        `temperature` (key 0): `mean@samples`, `pass@k` (`sampled_scores`).
      temperature: the sampling temperature of `samples`.

    Returns:
      `{"step", "accuracy"}`, plus `"accuracy_served"` and `"exporter"` with `served`,
      and `sampled_scores`' keys with `samples`.
    """
    from jaxrl_lp.lora import LoraWeights
    from jaxrl_lp.optim import OptimizerSpec
    from jaxrl_lp.sync.export import served_params_for_forward
    from jaxrl_lp.train.run_io import served_export
    from jaxrl_lp.train.task_source import TaskRecord, check_task_record

    ckpt = Checkpointer(cfg.run.out_dir, create=False)
    try:
        step = ckpt.resolve_step(step)
        task = build_task(cfg, task)
        check_task_record(cfg.run.out_dir, TaskRecord.of(task))
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

    max_new = g.max_new_tokens or task.max_completion_tokens
    size = size or cfg.run.eval_size

    def score(p):
        return evaluate(p, mcfg, task, g.policies.sampler, loop, size, max_new)

    out = {"step": step, "accuracy": score(params)}
    if samples:
        records = [task.heldout[i] for i in range(min(size, len(task.heldout)))]
        out.update(sampled_scores(heldout_rewards(
            params, mcfg, task, g.policies.sampler, loop, records, max_new,
            sampling=SamplingConfig(temperature=temperature), samples=samples)), samples=samples,
            temperature=temperature)
    if export is not None:
        out["accuracy_served"] = score(served_params_for_forward(export[0]))
        out["exporter"] = export[1]["exporter"]
    return out
