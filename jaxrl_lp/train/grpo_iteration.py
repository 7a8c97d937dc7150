"""One GRPO iteration of the training program: export, sample, score, update.

`grpo_iteration` mutates the run's state dict (params, GRPO optimizer state,
sync state) and returns the step's metrics. The jitted programs it calls (the
GRPO step, the learner's behaviour log-probs, the reference's) are built once
by `run_train` and passed in as `IterationPrograms`.

Which log-probs are computed is decided per update on the host
(`train.behaviour.ReplayRule`, `grpo.replay`): where an update computes with
the weights the sampler ran under its policy, the behaviour log-probs and the
hybrid's value are the rollout's recorded ones, and only the dense forward
runs. The metrics say what happened: `replayed_updates` (updates whose hybrid
value was replayed), `behaviour_recomputed` (1 where the behaviour log-probs
were computed, 0 where they were the rollout's), `replay_verified` (1 on the
`grpo.verify_every` steps, where the batch was replayed anyway and found
bit-equal to the sampler). The `mismatch_*` metrics are logged only where the
behaviour log-probs were computed: a mismatch nothing measured is not a 0.
`timing_s/<phase>` are the iteration's seconds by phase (export, sample,
score, behaviour, reference, update, sync).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.parallel.shard import to_host
from jaxrl_lp.rl.advantages import group_advantages, zero_variance_groups
from jaxrl_lp.rl.train_step import take_rows
from jaxrl_lp.rollout.generate import generate, pad_prompts
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.train.behaviour import PhaseTimer, ReplayRule, check_replay_equal
from jaxrl_lp.train.sync_hooks import SyncHooks

__all__ = ["IterationPrograms", "Reference", "grpo_iteration"]


class Reference(NamedTuple):
    """The frozen KL reference (`loss.kl_beta > 0`): its params and its log-prob program."""

    params: Any
    logprobs: Any                    # fn(params, rollout) -> [B, N], the learner's values


class IterationPrograms(NamedTuple):
    """What `run_train` builds once and every GRPO iteration calls."""

    grpo_step: Any                   # `make_grpo_step(...)`: one optimizer update
    behaviour_logprobs: Any          # `jit_learner_logprobs(...)`: the old log-probs
    rule: ReplayRule                 # when the recorded log-probs are the replay's
    verify_logprobs: Any = None      # the replay of the whole batch in one pass, as the
                                     # sampler ran it (`grpo.verify_every`); None: behaviour's
    reference: Reference | None = None
    model_params: Any = None         # train tree -> model params (`optim.weights`), or None


def _sample(state, step, cfg, plan, hooks, problems, timer, master):
    """Export, then the rollout of `problems` on the served weights; returns (ro, extras)."""
    g, tok = cfg.grpo, plan.task.tokenizer
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.run.seed), step)
    with timer("export"):
        served, sampler_params, state["sync"] = hooks.export(state["sync"], master)
        jax.block_until_ready(sampler_params)
    sample_kw = dict(policy=plan.sampler_policy,
                     sampling=SamplingConfig(temperature=g.temperature),
                     max_new_tokens=plan.max_new_tokens, num_samples=g.group_size,
                     eos_id=tok.eos_id, pad_id=tok.pad_id, loop=plan.loop, key=key,
                     weights_version=step, mesh=plan.mesh)
    prompts = [plan.task.prompt_ids(p) for p in problems]
    spec_metrics = {}
    with timer("sample"):
        if g.speculative:  # same samples, drafted and verified (`rollout.speculative`)
            from jaxrl_lp.rollout.speculative import speculative_generate

            ro, st = speculative_generate(sampler_params, plan.model, prompts, g.speculative,
                                          with_stats=True, **sample_kw)
            spec_metrics = {"spec_acceptance": st.acceptance_rate,
                            "spec_tokens_per_forward": st.tokens_per_target_forward(
                                ro.prompt_tokens.shape[0])}
        else:
            ro = generate(sampler_params, plan.model, prompts, **sample_kw)
        ro = jax.block_until_ready(ro)
    return ro, served, sampler_params, spec_metrics


def grpo_iteration(state: dict, step: int, cfg, plan, programs: IterationPrograms, prompt_it,
                   hooks: SyncHooks) -> dict:
    """One GRPO step: export, sample groups, score, advantages, `mu` passes of updates.

    With `plan.mesh` the sampler and the learner run sharded; what is computed
    on the host (rewards, advantages, metrics) is computed by every process on
    the whole batch (`to_host`), so they agree without further communication.
    `programs.model_params` maps a low-bit run's train tree (`state["params"]`,
    see `optim.weights`) to the model's params the sampler and diagnostics use.

    Raises:
      ReplayMismatchError: on a `grpo.verify_every` step, the replay of the batch
        under the sampler's weights was not the sampler's recorded bits.
    """
    g = cfg.grpo
    task, timer = plan.task, PhaseTimer()
    view = programs.model_params or (lambda p: p)
    problems = [task.train[int(i)] for i in prompt_it.next_global()]
    master = view(state["params"])
    ro, served, sampler_params, spec_metrics = _sample(state, step, cfg, plan, hooks, problems,
                                                       timer, master)
    with timer("score"):
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
    rule, old_logp_fn = programs.rule, programs.behaviour_logprobs
    # The weights the loss computes with: the served copy (constant over the step's updates)
    # or the master (moved by each update).
    loss_weights = (lambda: sampler_params) if on_served else (lambda: view(state["params"]))
    grpo_step_n = step - cfg.sft.steps
    verify = bool(g.verify_every) and grpo_step_n % g.verify_every == 0
    with timer("behaviour"):
        recorded = rule.recorded(ro, loss_weights())
        if recorded and not verify:
            old_logp = ro.logprobs  # the replay's values: nothing to compute
        elif recorded:  # a verification: the replay, at the sampler's shape, is its bits
            replay = programs.verify_logprobs or old_logp_fn
            old_logp = jax.block_until_ready(replay(sampler_params if on_served else master, ro))
            check_replay_equal(old_logp, ro, step)
        else:  # the behaviour log-probs as the learner computes them (on the copy the loss uses)
            old_logp = jax.block_until_ready(
                old_logp_fn(sampler_params if on_served else master, ro))
    measured = not (recorded and not verify)
    ref_logp = None
    if programs.reference is not None:
        with timer("reference"):  # once per batch, under the learner's policy
            ref = programs.reference
            ref_logp = jax.block_until_ready(ref.logprobs(ref.params, ro))
    sync_metrics = {}
    with timer("sync"):
        if hooks.active:
            master_logp = old_logp if not on_served else old_logp_fn(master, ro)
            state["sync"], sync_metrics = hooks.diagnostics(state["sync"], master, served, ro,
                                                            master_logp)
            k = cfg.sync.check_every
            if k and grpo_step_n % k == 0:
                tok = task.tokenizer
                probe = pad_prompts([task.prompt_ids(task.heldout[i]) for i in range(4)],
                                    tok.pad_id, bucket=False)[0]
                sync_metrics.update(hooks.check(step, master, served, jnp.asarray(probe)))
            sync_metrics = {k: float(v) for k, v in sync_metrics.items()}
    n = rewards.shape[0]
    size = n // g.minibatches
    sums: dict[str, float] = {}
    replayed = 0
    with timer("update"):
        for epoch in range(g.mu):
            for i in range(g.minibatches):
                idx = np.arange(i * size, (i + 1) * size)
                # Per update: the first computes with the sampler's weights, a later one
                # with the weights the updates before it made (unless the loss is on the
                # served copy, which the updates do not move).
                first = epoch == 0 and i == 0
                reuse = recorded if first or on_served else rule.recorded(ro, loss_weights())
                replayed += int(g.logprobs == "hybrid" and not reuse)
                state["params"], state["opt_grpo"], m = programs.grpo_step(
                    state["params"], state["opt_grpo"], take_rows(ro, idx),
                    jnp.asarray(adv[idx]), old_logp[idx],
                    None if ref_logp is None else ref_logp[idx],
                    sampler_params if on_served else None,
                    ro.logprobs[idx] if reuse else None)
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
    updates = g.mu * g.minibatches
    metrics = {k: v / updates for k, v in sums.items()
               if measured or not k.startswith("mismatch_")}
    metrics["skipped"] = float(sums.get("skipped", 0.0) > 0)
    metrics.update(sync_metrics)
    metrics.update(spec_metrics)
    mask = to_host(ro.completion_mask)
    lengths = mask.sum(1)
    t = timer.metrics()
    metrics.update(
        reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
        accuracy=float((rewards >= 1.0).mean()), response_length=float(lengths.mean()),
        tokens_per_s=float(lengths.sum() / max(t["timing_s/sample"], 1e-9)),
        update_tokens_per_s=float(g.mu * lengths.sum() / max(t["timing_s/update"], 1e-9)),
        learning_rate=g.lr, zero_variance_groups=float(n_zero_var),
        mean_exit_step=float((to_host(ro.exit_steps) * mask).sum() / max(lengths.sum(), 1)),
        replayed_updates=float(replayed), behaviour_recomputed=float(measured),
        replay_verified=float(recorded and verify), **t,
    )
    return metrics
