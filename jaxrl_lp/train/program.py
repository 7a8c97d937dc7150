"""The `jaxrl-lp train` program: supervised warm-start, then GRPO, resumable exactly.

A run directory holds `config.json`, `metrics.jsonl`, TensorBoard events
(`tb/`), PNG plots, orbax checkpoints and `summary.json`. Every source of
randomness is derived from `(run.seed, step)` and the data iterators'
states are checkpointed, so a resumed run continues with exactly the steps an
uninterrupted run would have taken.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_lp.data import ArithmeticTask, GSM8KTask, load_gsm8k, prompt_loader, sft_loader
from jaxrl_lp.models.model import init_params
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rl.advantages import group_advantages, zero_variance_groups
from jaxrl_lp.rl.logprobs import learner_logprobs
from jaxrl_lp.rl.train_step import make_grpo_step, make_sft_step, take_rows
from jaxrl_lp.rollout.generate import generate, pad_prompts
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.rollout.step import LoopSpec
from jaxrl_lp.train.checkpoint import Checkpointer
from jaxrl_lp.train.config import TrainConfig
from jaxrl_lp.train.logger import MetricsLogger, plot_metrics
from jaxrl_lp.train.sync_hooks import SyncConfig, SyncHooks

__all__ = ["NonFiniteError", "evaluate", "evaluate_run", "run_train"]


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


def _task_and_model(cfg: TrainConfig):
    if cfg.task.kind == "arithmetic":
        task = ArithmeticTask(ops=cfg.task.ops, max_digits=cfg.task.max_digits, seed=cfg.task.seed,
                              reverse_answer=cfg.task.reverse_answer,
                              pad_operands=cfg.task.pad_operands)
    else:
        from jaxrl_lp.models.tokenizer import HFTokenizer

        if not cfg.init_from:
            raise ValueError("task.kind='gsm8k' needs init_from=<HF checkpoint dir with "
                             "tokenizer.json>")
        task = GSM8KTask(load_gsm8k(cfg.task.path), HFTokenizer.from_file(cfg.init_from))
    tok = task.tokenizer
    if cfg.init_from:
        from jaxrl_lp.models.hf_io import load_hf_params, read_hf_config

        mcfg = read_hf_config(cfg.init_from)
        params = load_hf_params(cfg.init_from, mcfg)
    else:
        mcfg = cfg.model.replace(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                                 eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
        params = init_params(mcfg, jax.random.PRNGKey(cfg.run.seed))
    return task, mcfg, params


def evaluate(params, mcfg, task, policy, loop, size: int, max_new: int) -> float:
    """Greedy held-out accuracy on the first `size` held-out problems (deterministic)."""
    problems = [task.heldout[i] for i in range(min(size, len(task.heldout)))]
    tok = task.tokenizer
    ro = generate(params, mcfg, [task.prompt_ids(p) for p in problems], policy=policy,
                  sampling=SamplingConfig(greedy=True), max_new_tokens=max_new,
                  eos_id=tok.eos_id, pad_id=tok.pad_id, loop=loop)
    return float(np.mean(task.rewards(np.asarray(ro.completion_tokens), problems)))


def _optimizers(cfg: TrainConfig):
    """The warm-start optimizer (AdamW, warmup + cosine) and the GRPO one (clipped Adam)."""
    s = cfg.sft
    warmup = max(1, min(s.warmup_steps, s.steps // 2))
    sft = optax.adamw(optax.warmup_cosine_decay_schedule(
        0.0, s.lr, warmup, max(warmup + 1, s.steps)), weight_decay=0.0)
    grpo = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(cfg.grpo.lr))
    return sft, grpo


def evaluate_run(cfg: TrainConfig, size: int | None = None) -> dict:
    """Greedy held-out accuracy of the latest checkpoint in `cfg.run.out_dir`."""
    task, mcfg, params = _task_and_model(cfg)
    ckpt = Checkpointer(cfg.run.out_dir)
    step = ckpt.latest_step()
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {cfg.run.out_dir}/checkpoints; train first "
                                "or point run.out_dir at a run directory")
    sft_opt, grpo_opt = _optimizers(cfg)
    like = {"params": params, "opt_sft": sft_opt.init(params), "opt_grpo": grpo_opt.init(params)}
    state, _ = ckpt.restore(like, mcfg)
    ckpt.close()
    g = cfg.grpo
    acc = evaluate(state["params"], mcfg, task, Policy.parse(g.sampler_policy),
                   LoopSpec(g.exit_rule, g.compute_mode), size or cfg.run.eval_size,
                   g.max_new_tokens or task.max_completion_tokens)
    return {"step": step, "accuracy": acc}


def _resume(ckpt, state, cfg, mcfg, hooks, lpol, spol):
    """The latest checkpoint, when it was written with other sync settings too.

    Before GRPO has started the exporter's state is still its initial state, so
    a warm-start can be resumed with another `sync.exporter` (its state is made
    afresh); once GRPO steps have used the saved exporter, resuming with another
    would not continue that run, and is refused.
    """
    saved = ckpt.latest_meta().get("sync")
    if saved is None or saved.get("exporter") == cfg.sync.exporter:
        return ckpt.restore(state, mcfg)
    saved_hooks = SyncHooks(SyncConfig(**saved), mcfg, lpol, spol)
    restored, meta = ckpt.restore({**state, "sync": saved_hooks.init_state(state["params"])},
                                  mcfg)
    if meta["initial_accuracy"] is not None:
        raise ValueError(
            f"the run in {cfg.run.out_dir} has done GRPO steps with "
            f"sync.exporter={saved['exporter']}; resuming it with "
            f"sync.exporter={cfg.sync.exporter} would not continue that run. Resume with "
            f"--set sync.exporter={saved['exporter']}, or start the new exporter from a "
            "warm-start checkpoint (jaxrl-lp sft) in another run.out_dir")
    restored["sync"] = hooks.init_state(restored["params"])
    return restored, meta


def run_train(cfg: TrainConfig, *, stop_after: int | None = None) -> dict:
    """Runs (or resumes) a training run; returns the summary dict (also in summary.json).

    Args:
      cfg: the configuration.
      stop_after: stop once this global step is reached (tests use it to
        interrupt a run); the run can be resumed later.
    """
    t_start = time.time()
    task, mcfg, params = _task_and_model(cfg)  # bad task/data/model input fails before any write
    run_dir = Path(cfg.run.out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tok = task.tokenizer
    g = cfg.grpo
    max_new = g.max_new_tokens or task.max_completion_tokens
    lpol, spol = Policy.parse(g.learner_policy), Policy.parse(g.sampler_policy)
    loop = LoopSpec(g.exit_rule, g.compute_mode)

    sft_opt, grpo_opt = _optimizers(cfg)
    hooks = SyncHooks(cfg.sync, mcfg, lpol, spol)
    state = {"params": params, "opt_sft": sft_opt.init(params), "opt_grpo": grpo_opt.init(params),
             "sync": hooks.init_state(params)}
    sft_it = iter(sft_loader(task.train, task.sft_example, cfg.sft.batch_size, cfg.run.seed,
                             tok.pad_id, seq_len=task.max_sequence_length))
    prompt_it = iter(prompt_loader(task.train, g.prompts_per_step, cfg.run.seed + 1))
    meta = {"step": 0, "initial_accuracy": None, "nonfinite_in_row": 0, "skipped_total": 0}

    ckpt = Checkpointer(run_dir, keep=cfg.run.keep_checkpoints)
    if ckpt.latest_step() is not None:
        state, meta = _resume(ckpt, state, cfg, mcfg, hooks, lpol, spol)
        sft_it.set_state(meta["sft_data"])
        prompt_it.set_state(meta["prompt_data"])
    else:
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    logger = MetricsLogger(run_dir)

    sft_step = make_sft_step(mcfg, lpol, sft_opt)
    grpo_step = make_grpo_step(mcfg, lpol, loop, cfg.loss, grpo_opt, method=g.logprobs,
                               micro_batches=g.micro_batches)
    old_logp_fn = jax.jit(lambda p, ro: learner_logprobs(p, mcfg, lpol, loop, ro, g.logprobs)[0])
    total = cfg.sft.steps + g.steps
    evaluate_now = lambda p: evaluate(p, mcfg, task, spol, loop, cfg.run.eval_size, max_new)

    def save(step):
        meta.update(step=step, sft_data=sft_it.get_state(), prompt_data=prompt_it.get_state(),
                    model=json.loads(json.dumps(dataclasses.asdict(mcfg))),
                    sync=dataclasses.asdict(cfg.sync))
        ckpt.save(step, state, meta)

    bar = None
    if cfg.run.progress:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=meta["step"], desc="train", unit="step")
    step = meta["step"]
    while step < total and (stop_after is None or step < stop_after):
        if step < cfg.sft.steps:
            batch = next(sft_it)
            state["params"], state["opt_sft"], m = sft_step(
                state["params"], state["opt_sft"], jnp.asarray(batch.tokens_BxL),
                jnp.asarray(batch.loss_mask_BxL))
            phase = "sft"
        else:
            if meta["initial_accuracy"] is None:
                state["sync"], state["params"] = hooks.start(state["sync"], state["params"])
                meta["initial_accuracy"] = evaluate_now(state["params"])
                logger.log(step, "eval", {"accuracy": meta["initial_accuracy"]})
            m = _grpo_iteration(state, step, cfg, task, mcfg, spol, loop, max_new, grpo_step,
                                old_logp_fn, prompt_it, hooks)
            phase = "grpo"
        m = {k: float(v) for k, v in m.items()}
        meta["nonfinite_in_row"] = meta["nonfinite_in_row"] + 1 if m["skipped"] else 0
        meta["skipped_total"] += int(m["skipped"] > 0)
        step += 1
        logger.log(step, phase, m)
        if bar is not None:
            bar.update(1)
            bar.set_postfix({k: f"{m[k]:.3f}" for k in ("loss", "reward_mean") if k in m})
        if meta["nonfinite_in_row"] >= g.max_nonfinite_in_row:
            save(step)
            raise NonFiniteError(
                f"{meta['nonfinite_in_row']} steps in a row had a non-finite loss or gradient "
                f"(last at step {step}); they were skipped and nothing non-finite was saved. "
                "Lower the learning rate or check the data; grpo.max_nonfinite_in_row sets the limit")
        if step > cfg.sft.steps and (step - cfg.sft.steps) % cfg.run.eval_every == 0:
            logger.log(step, "eval", {"accuracy": evaluate_now(state["params"])})
        if step % cfg.run.checkpoint_every == 0 or step == total:
            save(step)
    if bar is not None:
        bar.close()
    if step < total:  # interrupted on purpose (stop_after)
        save(step)
        logger.close()
        ckpt.close()
        return {"steps": step, "interrupted": True}
    if meta["initial_accuracy"] is None:
        meta["initial_accuracy"] = evaluate_now(state["params"])
    final = evaluate_now(state["params"])
    final_served = None
    if hooks.active:  # what the sampler would serve next (a fresh export; the state is kept)
        _, served_params, _ = hooks.export(state["sync"], state["params"])
        final_served = evaluate_now(served_params)
    logger.log(step, "eval", {"accuracy": final} | (
        {} if final_served is None else {"accuracy_served": final_served}))
    records = logger.records()
    plot_metrics(records, run_dir)
    summary = {
        "initial_accuracy": meta["initial_accuracy"],
        "final_accuracy": final,
        "accuracy_gain": final - meta["initial_accuracy"],
        **({} if final_served is None else {"final_accuracy_served": final_served}),
        "steps": step,
        "sft_steps": cfg.sft.steps,
        "grpo_steps": g.steps,
        "skipped_steps": meta["skipped_total"],
        "wall_seconds": time.time() - t_start,
        "run_dir": str(run_dir),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    logger.close()
    ckpt.close()
    return summary


def _grpo_iteration(state, step, cfg, task, mcfg, spol, loop, max_new, grpo_step, old_logp_fn,
                    prompt_it, hooks: SyncHooks) -> dict:
    """One GRPO step: export, sample groups, score, advantages, `mu` passes of updates."""
    g = cfg.grpo
    tok = task.tokenizer
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.run.seed), step)
    problems = next(prompt_it)
    master = state["params"]
    served, sampler_params, state["sync"] = hooks.export(state["sync"], master)
    t0 = time.time()
    ro = generate(sampler_params, mcfg, [task.prompt_ids(p) for p in problems], policy=spol,
                  sampling=SamplingConfig(temperature=g.temperature), max_new_tokens=max_new,
                  num_samples=g.group_size, eos_id=tok.eos_id, pad_id=tok.pad_id, loop=loop,
                  key=key, weights_version=step)
    ro = jax.block_until_ready(ro)
    t_sample = time.time() - t0
    rewards = task.rewards(np.asarray(ro.completion_tokens),
                           [p for p in problems for _ in range(g.group_size)])
    adv = np.asarray(group_advantages(jnp.asarray(rewards), g.group_size, kind=g.advantage))
    n_zero_var = 0
    if g.dynamic_sampling:
        dead = np.repeat(np.asarray(zero_variance_groups(jnp.asarray(rewards), g.group_size)),
                         g.group_size)
        n_zero_var = int(dead.sum() // g.group_size)
        ro = dataclasses.replace(ro, completion_mask=ro.completion_mask * (1.0 - dead[:, None]))
    on_served = hooks.active and cfg.sync.loss_on_served
    # The behaviour log-probs as the learner computes them (on the copy the loss uses).
    old_logp = old_logp_fn(sampler_params if on_served else master, ro)
    sync_metrics = {}
    if hooks.active:
        master_logp = old_logp if not on_served else old_logp_fn(master, ro)
        state["sync"], sync_metrics = hooks.diagnostics(state["sync"], master, served, ro,
                                                        master_logp)
        k = cfg.sync.check_every
        if k and (step - cfg.sft.steps) % k == 0:
            probe = pad_prompts([task.prompt_ids(task.heldout[i]) for i in range(4)],
                                tok.pad_id, bucket=False)[0]
            sync_metrics.update(hooks.check(step, master, served, jnp.asarray(probe)))
    n = rewards.shape[0]
    size = n // g.minibatches
    sums: dict[str, float] = {}
    for _ in range(g.mu):
        for i in range(g.minibatches):
            idx = np.arange(i * size, (i + 1) * size)
            state["params"], state["opt_grpo"], m = grpo_step(
                state["params"], state["opt_grpo"], take_rows(ro, idx), jnp.asarray(adv[idx]),
                old_logp[idx], None, sampler_params if on_served else None)
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
    updates = g.mu * g.minibatches
    metrics = {k: v / updates for k, v in sums.items()}
    metrics["skipped"] = float(sums.get("skipped", 0.0) > 0)
    metrics.update({k: float(v) for k, v in sync_metrics.items()})
    lengths = np.asarray(ro.completion_mask).sum(1)
    metrics.update(
        reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
        accuracy=float((rewards >= 1.0).mean()), response_length=float(lengths.mean()),
        tokens_per_s=float(lengths.sum() / max(t_sample, 1e-9)), learning_rate=g.lr,
        zero_variance_groups=float(n_zero_var), mean_exit_step=float(
            (np.asarray(ro.exit_steps) * np.asarray(ro.completion_mask)).sum()
            / max(lengths.sum(), 1)),
    )
    return metrics
