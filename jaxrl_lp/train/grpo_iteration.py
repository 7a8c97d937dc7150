"""One GRPO iteration of the training program: export, sample, score, update.

`grpo_iteration` takes the run's `RunState` and returns the next one (new
params, GRPO optimizer state and sync state) with the step's metrics. The
jitted programs it calls (the GRPO step, the learner's behaviour log-probs,
the reference's) are built once by `run_train` and passed in as
`IterationPrograms`.

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

The rewards the advantages see are the task's plus, with `grpo.overlong_buffer`,
DAPO's overlong penalty (`overlong_penalty_mean`, `overlong_frac`; `reward_mean`
and `accuracy` stay the task's). `zero_variance_groups` counts the groups drawn
whose rewards were all equal. With `grpo.dynamic_sampling` the step draws
further batches until the batch is informative (`refill_rounds`,
`refilled_groups`, `masked_groups`, `informative_groups`; docs/design.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.parallel.shard import to_host
from jaxrl_lp.rl.advantages import group_advantages, overlong_penalty, zero_variance_groups
from jaxrl_lp.rl.dynamic_sampling import refill_groups
from jaxrl_lp.rl.train_step import take_rows
from jaxrl_lp.rollout.generate import concat_rollouts, generate, pad_prompts
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.train.behaviour import PhaseTimer, ReplayRule, check_replay_equal
from jaxrl_lp.train.run_state import RunState
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


def _export(sync, hooks, timer, master):
    """The step's one export: (served, sampler params, sync state); every round of the step
    samples these."""
    with timer("export"):
        served, sampler_params, sync = hooks.export(sync, master)
        jax.block_until_ready(sampler_params)
    return served, sampler_params, sync


def _sample(sampler_params, step, key, cfg, plan, problems, timer):
    """The rollout of `problems` (G samples each) on the served weights; returns (ro, spec metrics)."""
    g, tok = cfg.grpo, plan.task.tokenizer
    sample_kw = dict(policy=plan.sampler_policy,
                     sampling=SamplingConfig(temperature=g.temperature, draw=g.draw),
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
    return ro, spec_metrics


class _Round(NamedTuple):
    """One sampled batch of prompts (a dynamic-sampling step may draw several)."""

    ro: Any                          # its Rollout, as sampled (B rows)
    rewards: np.ndarray              # [B] the task's rewards
    penalty: np.ndarray              # [B] the overlong penalty (<= 0), zeros when off


def _score(ro, problems, cfg, plan, timer) -> tuple[np.ndarray, np.ndarray]:
    """(task rewards, overlong penalty) of a rollout, [B] f32 host arrays each."""
    g = cfg.grpo
    with timer("score"):
        rewards = plan.task.rewards(to_host(ro.completion_tokens),
                                    [p for p in problems for _ in range(g.group_size)])
        penalty = np.zeros_like(rewards)
        if g.overlong_buffer:  # counted in tokens, EOS included (`rl.advantages`)
            penalty = np.asarray(overlong_penalty(to_host(ro.completion_mask).sum(1),
                                                  plan.max_new_tokens, g.overlong_buffer,
                                                  g.overlong_penalty))
    return rewards, penalty


def _shaped(rewards: np.ndarray, penalty: np.ndarray) -> np.ndarray:
    """The rewards the advantages see: the task's plus the overlong penalty."""
    # No addition without a penalty: the default run's rewards are the task's, bit for bit.
    return rewards + penalty if penalty.any() else rewards


def grpo_iteration(state: RunState, step: int, cfg, plan, programs: IterationPrograms,
                   prompt_it, hooks: SyncHooks) -> tuple[RunState, dict]:
    """One GRPO step: export, sample groups, score, advantages, `mu` passes of updates.

    With `plan.mesh` the sampler and the learner run sharded; what is computed
    on the host (rewards, advantages, metrics) is computed by every process on
    the whole batch (`to_host`), so they agree without further communication.
    `programs.model_params` maps a low-bit run's train tree (`state.params`,
    see `optim.weights`) to the model's params the sampler and diagnostics use.

    With `grpo.dynamic_sampling`, further batches of prompts are drawn from
    `prompt_it` (so its checkpointed state covers them) and sampled on the same
    export until the batch holds `prompts_per_step` informative groups
    (`rl.dynamic_sampling.refill_groups`, at most `grpo.max_refill_rounds`
    further batches); the batch is their rows concatenated (`concat_rollouts`).

    Returns:
      `(state, metrics)`: the state after the step's updates (params,
      `opt_grpo` and `sync` new; `opt_sft` as it was), the metrics a dict of
      floats.

    Raises:
      ReplayMismatchError: on a `grpo.verify_every` step, the replay of the batch
        under the sampler's weights was not the sampler's recorded bits.
    """
    g = cfg.grpo
    task, timer = plan.task, PhaseTimer()
    view = programs.model_params or (lambda p: p)
    problems = [task.train[int(i)] for i in prompt_it.next_global()]
    # What the step updates: each update's params and GRPO optimizer state, the sync state.
    params, opt_grpo = state.params, state.opt_grpo
    master = view(params)
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.run.seed), step)
    served, sampler_params, sync = _export(state.sync, hooks, timer, master)
    ro, spec_metrics = _sample(sampler_params, step, key, cfg, plan, problems, timer)
    rounds = [_Round(ro, *_score(ro, problems, cfg, plan, timer))]
    ds_metrics, picked = {}, None
    if g.dynamic_sampling:
        def draw(r):  # round r >= 1: the next prompts of the run's stream, a key of their own
            if r:
                more = [task.train[int(i)] for i in prompt_it.next_global()]
                ro_r, sm = _sample(sampler_params, step, jax.random.fold_in(key, r), cfg, plan,
                                   more, timer)
                for k, v in sm.items():  # the rounds' mean
                    spec_metrics[k] = (spec_metrics[k] * r + v) / (r + 1)
                rounds.append(_Round(ro_r, *_score(ro_r, more, cfg, plan, timer)))
            return _shaped(rounds[r].rewards, rounds[r].penalty)

        picked = refill_groups(draw, g.prompts_per_step, g.group_size, g.max_refill_rounds)
        if not picked.single_round:
            parts = [(rnd, rows) for rnd, rows in zip(rounds, picked.rows, strict=True)
                     if len(rows)]
            ro = concat_rollouts([take_rows(rnd.ro, rows) for rnd, rows in parts],
                                 task.tokenizer.pad_id)
            if picked.masked_groups:  # the bound was hit: these groups leave the loss
                ro = dataclasses.replace(ro, completion_mask=ro.completion_mask * jnp.asarray(
                    1.0 - picked.masked_B[:, None], ro.completion_mask.dtype))
        ds_metrics = dict(refill_rounds=picked.refill_rounds,
                          refilled_groups=picked.refilled_groups,
                          masked_groups=picked.masked_groups,
                          informative_groups=g.prompts_per_step - picked.masked_groups)
    with timer("score"):
        if picked is None or picked.single_round:
            raw, penalty = rounds[0].rewards, rounds[0].penalty
        else:
            raw, penalty = (np.concatenate([getattr(rnd, f)[rows] for rnd, rows in parts])
                            for f in ("rewards", "penalty"))
        shaped = _shaped(raw, penalty)
        adv = np.asarray(group_advantages(jnp.asarray(shaped), g.group_size, kind=g.advantage))
        n_zero_var = (picked.zero_variance_groups if picked is not None else
                      int(np.asarray(zero_variance_groups(jnp.asarray(shaped),
                                                          g.group_size)).sum()))
    on_served = hooks.active and cfg.sync.loss_on_served
    rule, old_logp_fn = programs.rule, programs.behaviour_logprobs
    # The weights the loss computes with: the served copy (constant over the step's updates)
    # or the master (moved by each update).
    loss_weights = (lambda: sampler_params) if on_served else (lambda: view(params))
    grpo_step_n = step - cfg.sft.steps
    verify = bool(g.verify_every) and grpo_step_n % g.verify_every == 0
    with timer("behaviour"):
        recorded = rule.recorded(ro, loss_weights())
        if recorded and not verify:
            old_logp = ro.logprobs  # the replay's values: nothing to compute
        elif recorded:  # a verification: the replay, at the sampler's shape, is its bits
            replay = programs.verify_logprobs or old_logp_fn
            weights = sampler_params if on_served else master
            if picked is None or picked.single_round:
                old_logp = jax.block_until_ready(replay(weights, ro))
                check_replay_equal(old_logp, ro, step)
            else:  # each round as the sampler ran it (its rows, its shape), then the batch's rows
                got = []
                for rnd, rows in parts:
                    lp = jax.block_until_ready(replay(weights, rnd.ro))
                    check_replay_equal(lp, rnd.ro, step)
                    got.append(lp[rows])
                old_logp = jnp.concatenate(got)
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
            sync, sync_metrics = hooks.diagnostics(sync, master, served, ro, master_logp)
            k = cfg.sync.check_every
            if k and grpo_step_n % k == 0:
                tok = task.tokenizer
                probe = pad_prompts([task.prompt_ids(task.heldout[i]) for i in range(4)],
                                    tok.pad_id, bucket=False)[0]
                sync_metrics.update(hooks.check(step, master, served, jnp.asarray(probe)))
            sync_metrics = {k: float(v) for k, v in sync_metrics.items()}
    n = shaped.shape[0]
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
                params, opt_grpo, m = programs.grpo_step(
                    params, opt_grpo, take_rows(ro, idx),
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
    metrics.update(ds_metrics)
    mask = to_host(ro.completion_mask)
    lengths = mask.sum(1)
    # Every token sampled this step, in all rounds (a refill's too), over the sampling seconds.
    sampled = lengths.sum() if len(rounds) == 1 else sum(
        to_host(rnd.ro.completion_mask).sum() for rnd in rounds)
    t = timer.metrics()
    metrics.update(
        reward_mean=float(raw.mean()), reward_std=float(raw.std()),
        accuracy=float((raw >= 1.0).mean()), response_length=float(lengths.mean()),
        overlong_penalty_mean=float(penalty.mean()), overlong_frac=float((penalty < 0).mean()),
        tokens_per_s=float(sampled / max(t["timing_s/sample"], 1e-9)),
        update_tokens_per_s=float(g.mu * lengths.sum() / max(t["timing_s/update"], 1e-9)),
        learning_rate=g.lr, zero_variance_groups=float(n_zero_var),
        mean_exit_step=float((to_host(ro.exit_steps) * mask).sum() / max(lengths.sum(), 1)),
        replayed_updates=float(replayed), behaviour_recomputed=float(measured),
        replay_verified=float(recorded and verify), **t,
    )
    return dataclasses.replace(state, params=params, opt_grpo=opt_grpo, sync=sync), metrics
