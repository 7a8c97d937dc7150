"""The `jaxrl-lp train` program: supervised warm-start, then GRPO, resumable exactly.

A run directory holds `config.json`, `metrics.jsonl`, TensorBoard events
(`tb/`), PNG plots, orbax checkpoints and `summary.json`. Every source of
randomness is derived from `(run.seed, step)` and the data iterators'
states are checkpointed, so a resumed run continues with exactly the steps an
uninterrupted run would have taken.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_lp.data import prompt_loader, sft_loader
from jaxrl_lp.envs import EnvRunner
from jaxrl_lp.lora import LoraParams
from jaxrl_lp.models.lora import merge_adapters
from jaxrl_lp.models.model import init_params
from jaxrl_lp.models.remat import Remat
from jaxrl_lp.parallel import param_shardings
from jaxrl_lp.parallel.data import ShardedLoader
from jaxrl_lp.parallel.distributed import initialize
from jaxrl_lp.parallel.shard import batch_shardings, put_tree, state_shardings
from jaxrl_lp.rl.logprob_programs import jit_learner_logprobs
from jaxrl_lp.rl.train_step import make_grpo_step, make_sft_step
from jaxrl_lp.train.behaviour import ReplayRule
from jaxrl_lp.train.checkpoint import Checkpointer
from jaxrl_lp.train.config import TrainConfig
from jaxrl_lp.train.episodes import is_multiturn
from jaxrl_lp.train.evaluation import evaluate
from jaxrl_lp.train.grpo_iteration import (
    IterationPrograms,
    Reference,
    dispatch_rollout,
    grpo_iteration,
    sample_step_episodes,
    sampler_side,
    sampling_key,
)
from jaxrl_lp.train.logger import MetricsLogger, WandbSettings, plot_metrics
from jaxrl_lp.train.logprobs_choice import with_logprobs
from jaxrl_lp.train.lora_run import LoraCheckpoints, begin_lora
from jaxrl_lp.train.preemption import Preempted, SignalGuard
from jaxrl_lp.train.probe import probe_exactness, probe_rewards
from jaxrl_lp.train.progress import PhaseProgress
from jaxrl_lp.train.reference import reference_params
from jaxrl_lp.train.resume import restore_newest_intact
from jaxrl_lp.train.rollout_queue import RolloutQueue, weights_key
from jaxrl_lp.train.run_lock import RunLock
from jaxrl_lp.train.run_state import Progress, RunState
from jaxrl_lp.train.sync_hooks import SyncHooks
from jaxrl_lp.train.task_source import TaskRecord, check_task_record
from jaxrl_lp.train.validate import RunPlan, validate
from jaxrl_lp.xla_flags import apply as apply_xla_gpu_flags
from jaxrl_lp.xla_flags import parse as parse_xla_gpu_flags

__all__ = ["NonFiniteError", "initial_state", "run_train"]


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


def initial_state(cfg: TrainConfig, plan: RunPlan | None = None
                  ) -> tuple[RunPlan, RunState, SyncHooks]:
    """The state a run of `cfg` starts from, and what it is built from.

    Returns:
      `(plan, state, hooks)`: the validated `RunPlan`, the `RunState` a run
      checkpoints (`params` from `init_from` or a seeded random init,
      `opt_sft`, `opt_grpo`, `sync`; `state.tree()` is the checkpointed dict)
      and the `SyncHooks` of `cfg.sync`. With a
      low-bit `sft.optimizer`, or LoRA on an `init_from` base, `params` is the
      train tree of `plan.weights` (`plan.weights.materialize(params)` gives
      the model's params).
    """
    plan = plan or validate(cfg)
    mcfg, mesh = plan.model, plan.mesh
    param_sh = None
    if mesh is not None:  # built sharded: no device ever holds a whole parameter
        shapes = jax.eval_shape(lambda: init_params(mcfg, jax.random.PRNGKey(0)))
        param_sh = param_shardings(shapes, mcfg, mesh)
    if cfg.init_from:
        from jaxrl_lp.models.hf_io import load_hf_params

        params = load_hf_params(cfg.init_from, mcfg, shardings=param_sh)
    elif mesh is None:  # op by op, as the recorded runs were made
        params = init_params(mcfg, jax.random.PRNGKey(cfg.run.seed))
    else:
        # Jitted straight into the shards (threefry is partitionable: the draws do not
        # depend on the sharding; fused, they differ from op-by-op ones in the last bit).
        init = jax.jit(lambda k: init_params(mcfg, k), out_shardings=param_sh)
        params = init(jax.random.PRNGKey(cfg.run.seed))
    sft_opt, grpo_opt = plan.optimizers
    hooks = SyncHooks(cfg.sync, mcfg, plan.learner_policy, plan.sampler_policy,
                      exporter=None if plan.lora is None else plan.lora.exporter)
    weights = plan.weights
    if weights is None:
        # LoRA on the run's own warm-start exports nothing before its GRPO phase (`begin_lora`).
        lora_later = plan.lora is not None
        state = RunState(params=params, opt_sft=sft_opt.init(params),
                         opt_grpo=grpo_opt.init(params),
                         sync={} if lora_later else hooks.init_state(params))
    else:  # the train tree (`sft.optimizer`: e.g. int8 codes and scales; LoRA: base, adapters)
        train = weights.from_params(params)
        del params
        if mesh is not None:  # the base is placed already; the adapters follow the rules
            param_sh = param_shardings(train, mcfg, mesh)
            params = train = put_tree(train, param_sh)
        opt = weights.optimized(train)
        state = RunState(params=train, opt_sft=sft_opt.init(opt), opt_grpo=grpo_opt.init(opt),
                         sync=hooks.init_state(weights.materialize(train)))
    if mesh is not None:  # the params are placed already; the rest follows them
        put = lambda v: put_tree(v, state_shardings(v, params, param_sh, mesh))
        state = RunState(params=state.params, opt_sft=put(state.opt_sft),
                         opt_grpo=put(state.opt_grpo), sync=put(state.sync))
    return plan, state, hooks


# The progress bar's figures: the loss and reward, and a GRPO iteration's split by phase.
_BAR_PHASES = ("sample", "behaviour", "update")


def _postfix(m: dict) -> dict:
    out = {k: m[k] for k in ("loss", "reward_mean") if k in m}
    out.update({f"{p}_s": m[f"timing_s/{p}"] for p in _BAR_PHASES if f"timing_s/{p}" in m})
    return out


def _rollout_queue(cfg: TrainConfig, plan: RunPlan, prompt_it, total: int,
                   runner: EnvRunner | None) -> RolloutQueue | None:
    """The off-policy run's rollouts in flight (`grpo.max_staleness > 0`), else None. A
    multi-turn task's are calls of episodes (`runner` steps their environments), sampled
    when dispatched: the host steps the environments between turns."""
    g = cfg.grpo
    if not g.max_staleness:
        return None
    side = sampler_side(plan)
    task = plan.task

    def dispatch(step, version, weights, problems):
        key, records = sampling_key(cfg.run.seed, step), [task.train[i] for i in problems]
        if runner is not None:
            return sample_step_episodes(weights.copies[0], version, key, cfg, plan, records,
                                        runner), {}
        return dispatch_rollout(weights, version, key, cfg, plan, records, side)

    return RolloutQueue(g.max_staleness, dispatch,
                        lambda: [int(i) for i in prompt_it.next_global()], end=total)


def _restore_like(cfg: TrainConfig, state: RunState, plan: RunPlan, queue: RolloutQueue | None):
    """What a checkpoint restores into, from its metadata: the run's state tree, and for an
    off-policy run the sampler's weights of the versions it lists (placed where the sampler
    runs). A run inside GRPO must resume with the `grpo.max_staleness` it was saved with."""
    like = None
    if queue is not None:
        mcfg = plan.model
        shapes = jax.eval_shape(lambda: init_params(mcfg, jax.random.PRNGKey(0)))
        side = sampler_side(plan)
        mesh = side.sampler_mesh
        if mesh is not None:
            shardings = param_shardings(shapes, mcfg, mesh)
        else:  # one device: the sampler's, its first replica's, or the learner's
            device = (side.replicas[0] if side.replicas else side.device) if side.separate \
                else (side.learner_device or jax.devices()[0])
            shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), shapes)
        like = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                            shapes, shardings)

    def tree(meta: dict) -> dict:
        saved = int(meta.get("max_staleness", 0))
        if meta.get("initial_accuracy") is not None and saved != cfg.grpo.max_staleness:
            raise ValueError(
                f"the run in {cfg.run.out_dir} has done GRPO steps with grpo.max_staleness="
                f"{saved}; resuming it with grpo.max_staleness={cfg.grpo.max_staleness} would "
                f"not continue that run (its rollouts in flight were sampled for {saved}). "
                f"Resume with --set grpo.max_staleness={saved}, or train into another "
                "run.out_dir")
        out = state.tree()
        versions = sorted({int(p["version"]) for p in meta.get("pending", [])})
        if versions:
            out["sampler"] = {weights_key(v): like for v in versions}
        return out

    return tree


def _complete(run_dir: Path, ckpt: Checkpointer, total: int) -> dict | None:
    """The saved summary of a run that has done all `total` steps, else None."""
    steps = ckpt.steps()
    if steps and steps[-1] > total:
        raise ValueError(f"the run in {run_dir} has done {steps[-1]} steps, more than this "
                         f"config's sft.steps + grpo.steps = {total}; raise them, or train "
                         "into another run.out_dir")
    summary = run_dir / "summary.json"
    if not steps or steps[-1] != total or not summary.is_file():
        return None
    return json.loads(summary.read_text())


def _complete_on_disk(run_dir: Path, cfg: TrainConfig) -> dict | None:
    """A complete run's summary in `run_dir` (read only), else None."""
    summary = run_dir / "summary.json"
    if not summary.is_file():
        return None
    done = json.loads(summary.read_text())
    return done if done.get("steps") == cfg.sft.steps + cfg.grpo.steps else None


def run_train(cfg: TrainConfig, task: Any = None, *, stop_after: int | None = None,
              refresh: bool = False, config_file: str = "") -> dict:
    """Runs (or resumes) a training run; returns the summary dict (also in summary.json).

    Everything is validated before the run directory is touched (`validate`),
    and a run that takes the sampler's log-probs as its own first checks that
    the replay is the sampler's bits here (`train.probe`); a task's reward
    functions are called on its reference completions first (`probe_rewards`).
    The run records its task in `task.json` (`train.task_source.TaskRecord`): a
    run resumed with another task is refused before anything is written.
    The run directory is then locked for the whole run (`RunLock`: a second
    process on it fails at once, and changes nothing). A run resumes from its
    newest intact checkpoint, setting damaged ones aside (`restore_newest_intact`),
    and `metrics.jsonl` keeps the records written up to that checkpoint. A run
    that is already complete is left as it is and its summary returned (with
    `"complete": true`), unless `refresh` asks for the final evaluation,
    summary and plots again.

    Args:
      cfg: the configuration.
      task: the task to train, any object implementing `tasks.Task` (a single-turn task
        with `rewards`, or a multi-turn one with `make_env`); None: `cfg.task`'s.
      stop_after: stop once this global step is reached (tests use it to
        interrupt a run); the run can be resumed later.
      refresh: recompute a complete run's final evaluation, summary and plots.
      config_file: the config file that defined `task` (recorded in `task.json`, so
        `jaxrl-lp eval --run` finds the task again).
    """
    t_start = time.time()
    # XLA reads XLA_FLAGS once, when JAX's backend starts: the run's GPU flags go first.
    apply_xla_gpu_flags(parse_xla_gpu_flags(cfg.run.xla_gpu_flags))
    initialize(cfg.distributed)  # the processes join before the mesh is laid over them
    plan = validate(cfg, task)  # every setting, before anything is built or written
    if cfg.grpo.logprobs == "auto":  # the method chosen once; config.json records it
        cfg = with_logprobs(cfg, plan.logprobs)
        if jax.process_index() == 0:
            print(f"jaxrl-lp train: grpo.logprobs=auto: {plan.logprobs.method} "
                  f"({plan.logprobs.why})", file=sys.stderr)
    run_dir = Path(cfg.run.out_dir)
    record = TaskRecord.of(plan.task, config_file)
    check_task_record(run_dir, record)  # a resumed run trains the task it started with
    if _complete_on_disk(run_dir, cfg) is None:  # replay == sampler here, before any write
        probe_rewards(cfg, plan)
        probe_exactness(cfg, plan)
    run_dir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0 and TaskRecord.read(run_dir) is None:
        record.write(run_dir)
    # One lock per run: process 0 holds it for all the run's processes. SIGTERM and SIGINT
    # stop the run after the step they arrive in, with a checkpoint (`train.preemption`).
    # A one-device learner of its own (`run.learner_mesh=data=1@K`) computes on its device.
    learner_device = None if plan.sampler is None else plan.sampler.learner_device
    with RunLock(run_dir) if jax.process_index() == 0 else contextlib.nullcontext(), \
            SignalGuard(cfg.run.save_on_signal) as guard, \
            jax.default_device(learner_device) if learner_device is not None \
            else contextlib.nullcontext():
        return _run_locked(cfg, plan, run_dir, t_start, stop_after, refresh, guard)


def _run_locked(cfg: TrainConfig, plan: RunPlan, run_dir: Path, t_start: float,
                stop_after: int | None, refresh: bool, guard: SignalGuard) -> dict:
    g = cfg.grpo
    total = cfg.sft.steps + g.steps
    ckpt = Checkpointer(run_dir, keep=cfg.run.keep_checkpoints)
    try:
        done = None if refresh else _complete(run_dir, ckpt, total)
        if done is not None:
            print(f"jaxrl-lp train: the run in {run_dir} is complete ({total} of {total} steps); "
                  "nothing was changed (--refresh redoes its final evaluation, summary and "
                  "plots)", file=sys.stderr)
            return {**done, "complete": True}
        return _train(cfg, plan, run_dir, ckpt, t_start, stop_after, guard)
    finally:
        ckpt.close()


def _train(cfg: TrainConfig, plan: RunPlan, run_dir: Path, ckpt: Checkpointer, t_start: float,
           stop_after: int | None, guard: SignalGuard) -> dict:
    task, mcfg, loop = plan.task, plan.model, plan.loop
    lpol, spol, max_new = plan.learner_policy, plan.sampler_policy, plan.max_new_tokens
    sft_opt, grpo_opt = plan.optimizers
    tok = task.tokenizer
    g = cfg.grpo
    _, state, hooks = initial_state(cfg, plan)
    primary = jax.process_index() == 0  # writes the run's files; every process computes
    mesh = plan.mesh
    lora = plan.lora  # LoRA: its checkpoints hold the adapters, and the base's identity
    if lora is not None:
        base_sh = None if mesh is None else param_shardings(
            jax.eval_shape(lambda: init_params(mcfg, jax.random.PRNGKey(0))), mcfg, mesh)
        ckpt = LoraCheckpoints(ckpt, lora, cfg, mcfg, plan.optimizers, hooks, shardings=base_sh)
    # Each process reads the data shards of its devices; every process gets the global batch.
    # No warm-start (sft.steps=0, e.g. from a pretrained checkpoint): the task needs no
    # `sft_example`, and no warm-start data is read.
    sft_it = ShardedLoader(
        lambda d, n: sft_loader(task.train, task.sft_example, cfg.sft.batch_size // n,
                                cfg.run.seed, tok.pad_id, seq_len=plan.seq_len, shard=(d, n)),
        mesh, to_array=lambda b: (b.tokens_BxL, b.loss_mask_BxL)) if cfg.sft.steps else None
    prompt_it = ShardedLoader(
        lambda d, n: prompt_loader(range(len(task.train)), g.prompts_per_step // n,
                                   cfg.run.seed + 1, shard=(d, n)), mesh)
    progress = Progress()
    total = cfg.sft.steps + g.steps
    # A multi-turn task's environments, stepped on host threads for the whole run.
    runner = (EnvRunner(timeout_s=cfg.task.env_timeout_s, failure_reward=cfg.task.failure_reward)
              if is_multiturn(task) else None)
    queue = _rollout_queue(cfg, plan, prompt_it, total, runner)
    resumed = restore_newest_intact(ckpt, _restore_like(cfg, state, plan, queue), cfg, mcfg,
                                    hooks, lpol, spol)
    if resumed is not None:
        tree, meta = resumed
        state, progress = RunState.from_tree(tree), Progress.from_meta(meta)
        if sft_it is not None:
            sft_it.set_state(meta["sft_data"])
        prompt_it.set_state(meta["prompt_data"])
        if queue is not None:  # the rollouts in flight, dispatched again on their weights
            side = sampler_side(plan)
            queue.restore(meta.get("pending", []), state.sampler or {},
                          lambda tree: side.hold(tree, copy=False))
            state = dataclasses.replace(state, sampler=None)
    # Records past the checkpoint are redone by this run: keep one record per step. W&B
    # (`run.wandb`) starts before the config is written: a refused login writes no config.
    wandb = WandbSettings(project=cfg.run.wandb_project, mode=cfg.run.wandb_mode,
                          config=json.loads(json.dumps(dataclasses.asdict(cfg)))) \
        if cfg.run.wandb else None
    logger = MetricsLogger(run_dir, keep_records=progress.metrics_records, write=primary,
                           wandb=wandb)
    if resumed is None and primary:
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))

    weights = plan.weights  # None: the params are the model's (the default run)
    # LoRA on the run's own warm-start: full warm-start steps, then LoRA GRPO steps.
    grpo_weights = weights if lora is None else lora.weights
    remat = Remat.of(g.remat)
    sft_step = make_sft_step(mcfg, lpol, sft_opt, mesh=mesh, remat=remat, weights=weights)
    grpo_step = make_grpo_step(mcfg, lpol, cfg.loss, grpo_opt, loop=loop, sampler_policy=spol,
                               method=g.logprobs, micro_batches=g.micro_batches, mesh=mesh,
                               remat=remat, weights=grpo_weights,
                               invariant_form=g.invariant_form)
    # What the sampler, evaluation and export read: the model's params. LoRA composes the
    # base and its adapters without a copy (a full tree before its phase passes as it is).
    if grpo_weights is None:
        model_params = lambda p: p
    elif lora is not None:
        model_params = grpo_weights.materialize
    else:
        model_params = jax.jit(grpo_weights.materialize)
    # The behaviour log-probs of the whole batch (and the KL reference's, with its params: the
    # same program): hybrid, the replay by the sampler's own program at its calls' shapes,
    # which also verifies (`rollout.replay`); dense, one micro-batch's rows at a time.
    old_logp_fn = jit_learner_logprobs(mcfg, lpol, g.logprobs, loop=loop, mesh=mesh,
                                       micro_batches=g.minibatches * g.micro_batches,
                                       form=g.invariant_form)
    programs = IterationPrograms(
        grpo_step=grpo_step, behaviour_logprobs=old_logp_fn,
        rule=ReplayRule(g.replay, g.logprobs, matched=lpol == spol),
        model_params=None if grpo_weights is None else model_params, env_runner=runner)
    if cfg.loss.kl_beta > 0 and progress.initial_accuracy is not None:  # resumed inside GRPO
        programs = programs._replace(reference=Reference(
            reference_params(cfg, plan, run_dir, None), old_logp_fn))
    # Held-out accuracy of the model's params (`score`), or of the run's own (`evaluate_now`:
    # a low-bit run's train tree is materialized first).
    score = lambda p: evaluate(p, mcfg, task, spol, loop, cfg.run.eval_size, max_new, mesh)
    evaluate_now = lambda p: score(model_params(p))

    def save(state: RunState, progress: Progress):
        # The counters, then what the iterators, the model and the sync settings are.
        meta = dict(progress.meta(), metrics_records=logger.lines,
                    sft_data=None if sft_it is None else sft_it.get_state(),
                    prompt_data=prompt_it.get_state(),
                    model=json.loads(json.dumps(dataclasses.asdict(mcfg))),
                    sync=dataclasses.asdict(cfg.sync))
        if queue is not None:  # the rollouts in flight and the sampler's weights they need
            meta.update(max_staleness=g.max_staleness, pending=queue.meta())
            state = dataclasses.replace(state, sampler=queue.tree() or None)
        ckpt.save(progress.step, state.tree(), meta)
    bar = PhaseProgress([("warm-start", cfg.sft.steps), ("grpo", g.steps)], progress.step,
                        enabled=cfg.run.progress and primary)
    while progress.step < total and (stop_after is None or progress.step < stop_after):
        step = progress.step
        if step < cfg.sft.steps:
            tokens, mask = sft_it.next_global()
            if mesh is not None:  # rows over the data shards, from the host batch
                tokens, mask = put_tree((tokens, mask), batch_shardings((tokens, mask), mesh))
            params, opt_sft, m = sft_step(state.params, state.opt_sft, jnp.asarray(tokens),
                                          jnp.asarray(mask))
            state = dataclasses.replace(state, params=params, opt_sft=opt_sft)
            phase = "sft"
        else:
            if progress.initial_accuracy is None:
                if lora is not None and not isinstance(state.params, LoraParams):
                    state = begin_lora(state, lora, grpo_opt, run_dir, mcfg, step)
                if grpo_weights is None:
                    sync, params = hooks.start(state.sync, state.params)
                    state = dataclasses.replace(state, sync=sync, params=params)
                else:  # sync.bf16_start is refused for these (validate)
                    sync, _ = hooks.start(state.sync, model_params(state.params))
                    state = dataclasses.replace(state, sync=sync)
                if cfg.loss.kl_beta > 0:  # frozen here: the GRPO phase's starting weights
                    programs = programs._replace(reference=Reference(reference_params(
                        cfg, plan, run_dir, merge_adapters(model_params(state.params))),
                        old_logp_fn))
                progress = dataclasses.replace(progress,
                                               initial_accuracy=evaluate_now(state.params))
                logger.log(step, "eval", {"accuracy": progress.initial_accuracy})
            state, m = grpo_iteration(state, step, cfg, plan, programs, prompt_it, hooks, queue)
            phase = "grpo"
        m = {k: float(v) for k, v in m.items()}
        progress = progress.counted(skipped=m["skipped"] > 0)
        step = progress.step
        logger.log(step, phase, m)
        bar.update(step, _postfix(m))
        if progress.nonfinite_in_row >= g.max_nonfinite_in_row:
            save(state, progress)
            bar.close()
            raise NonFiniteError(
                f"{progress.nonfinite_in_row} steps in a row had a non-finite loss or gradient "
                f"(last at step {step}); they were skipped and nothing non-finite was saved. "
                "Lower the learning rate or check the data; grpo.max_nonfinite_in_row sets the limit")
        # Periodic evaluation; the last step's is the final evaluation below.
        if cfg.sft.steps < step < total and (step - cfg.sft.steps) % cfg.run.eval_every == 0:
            logger.log(step, "eval", {"accuracy": evaluate_now(state.params)})
        saved = step % cfg.run.checkpoint_every == 0 or step == total
        if saved:
            save(state, progress)
        if signum := guard.agreed():  # every process stops after the same step
            if not saved:
                save(state, progress)
            bar.close()
            logger.close()
            raise Preempted(step, signum, str(run_dir))
    bar.close()
    step = progress.step
    if step < total:  # interrupted on purpose (stop_after)
        save(state, progress)
        logger.close()
        return {"steps": step, "interrupted": True}
    if progress.initial_accuracy is None:
        progress = dataclasses.replace(progress, initial_accuracy=evaluate_now(state.params))
    final = evaluate_now(state.params)
    final_served = None
    if hooks.active:  # what the sampler would serve next (a fresh export; the state is kept)
        _, served_params, _ = hooks.export(state.sync, model_params(state.params))
        final_served = score(served_params)  # the model's params already
    logger.log(step, "eval", {"accuracy": final} | (
        {} if final_served is None else {"accuracy_served": final_served}))
    if primary:
        plot_metrics(logger.records(), run_dir)
    summary = {
        "initial_accuracy": progress.initial_accuracy,
        "final_accuracy": final,
        "accuracy_gain": final - progress.initial_accuracy,
        **({} if final_served is None else {"final_accuracy_served": final_served}),
        "steps": step,
        "sft_steps": cfg.sft.steps,
        "grpo_steps": g.steps,
        "skipped_steps": progress.skipped_total,
        "wall_seconds": time.time() - t_start,
        "run_dir": str(run_dir),
    }
    if primary:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    logger.close()
    return summary
