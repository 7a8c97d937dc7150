"""One GRPO iteration of the training program: export, sample, score, update.

`grpo_iteration` mutates the run's state dict (params, GRPO optimizer state,
sync state) and returns the step's metrics. The jitted programs it calls (the
sampler, the learner's old log-probs and the GRPO step) are built once by
`run_train` and passed in.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.parallel.shard import to_host
from jaxrl_lp.rl.advantages import group_advantages, zero_variance_groups
from jaxrl_lp.rl.train_step import take_rows
from jaxrl_lp.rollout.generate import generate, pad_prompts
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.train.sync_hooks import SyncHooks

__all__ = ["grpo_iteration"]


def grpo_iteration(state, step, cfg, task, mcfg, spol, loop, max_new, grpo_step, old_logp_fn,
                   prompt_it, hooks: SyncHooks, mesh=None, model_params=None) -> dict:
    """One GRPO step: export, sample groups, score, advantages, `mu` passes of updates.

    With `mesh` the sampler and the learner run sharded; what is computed on
    the host (rewards, advantages, metrics) is computed by every process on the
    whole batch (`to_host`), so they agree without further communication.
    `model_params` maps a low-bit run's train tree (`state["params"]`, see
    `optim.weights`) to the model's params the sampler and diagnostics use.
    """
    g = cfg.grpo
    tok = task.tokenizer
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.run.seed), step)
    problems = [task.train[int(i)] for i in prompt_it.next_global()]
    master = state["params"] if model_params is None else model_params(state["params"])
    served, sampler_params, state["sync"] = hooks.export(state["sync"], master)
    t0 = time.time()
    sample_kw = dict(policy=spol, sampling=SamplingConfig(temperature=g.temperature),
                     max_new_tokens=max_new, num_samples=g.group_size, eos_id=tok.eos_id,
                     pad_id=tok.pad_id, loop=loop, key=key, weights_version=step, mesh=mesh)
    prompts = [task.prompt_ids(p) for p in problems]
    spec_metrics = {}
    if g.speculative:  # same samples, drafted and verified (`rollout.speculative`)
        from jaxrl_lp.rollout.speculative import speculative_generate

        ro, st = speculative_generate(sampler_params, mcfg, prompts, g.speculative,
                                      with_stats=True, **sample_kw)
        spec_metrics = {"spec_acceptance": st.acceptance_rate,
                        "spec_tokens_per_forward": st.tokens_per_target_forward(
                            ro.prompt_tokens.shape[0])}
    else:
        ro = generate(sampler_params, mcfg, prompts, **sample_kw)
    ro = jax.block_until_ready(ro)
    t_sample = time.time() - t0
    rewards = task.rewards(to_host(ro.completion_tokens),
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
    metrics.update(spec_metrics)
    mask = to_host(ro.completion_mask)
    lengths = mask.sum(1)
    metrics.update(
        reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
        accuracy=float((rewards >= 1.0).mean()), response_length=float(lengths.mean()),
        tokens_per_s=float(lengths.sum() / max(t_sample, 1e-9)), learning_rate=g.lr,
        zero_variance_groups=float(n_zero_var), mean_exit_step=float(
            (to_host(ro.exit_steps) * mask).sum()
            / max(lengths.sum(), 1)),
    )
    return metrics
