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
`refilled_groups`, `masked_groups`, `informative_groups`; docs/design/dynamic_sampling.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.models.recorded import take_product_rows
from jaxrl_lp.numerics.invariant import unsupported as invariant_unsupported
from jaxrl_lp.parallel.shard import to_host
from jaxrl_lp.rl.advantages import group_advantages, overlong_penalty, zero_variance_groups
from jaxrl_lp.rl.dynamic_sampling import refill_groups
from jaxrl_lp.rl.metrics import mismatch_metrics
from jaxrl_lp.rl.train_step import take_rows
from jaxrl_lp.rollout.generate import concat_rollouts, pad_prompts
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.tasks.rewards import RewardBatch
from jaxrl_lp.train.behaviour import PhaseTimer, ReplayRule, check_replay_equal
from jaxrl_lp.train.rollout_queue import RolloutQueue, SamplerSide
from jaxrl_lp.train.run_state import RunState
from jaxrl_lp.train.sync_hooks import SyncHooks

__all__ = ["IterationPrograms", "Reference", "dispatch_rollout", "grpo_iteration",
           "sample_step_episodes", "sampler_layout", "sampler_side", "sampling_key"]


def sampler_side(plan) -> SamplerSide:
    """Where a run's sampler runs: its own devices (`plan.sampler`), or the learner's."""
    return plan.sampler or SamplerSide(learner_mesh=plan.mesh, model=plan.model)


def sampling_key(seed: int, step: int) -> jax.Array:
    """The sampling key of the rollout global step `step` learns from (refills fold in more)."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), step)


class Reference(NamedTuple):
    """The frozen KL reference (`loss.kl_beta > 0`): its params and its log-prob program."""

    params: Any
    logprobs: Any                    # fn(params, rollout) -> [B, N], the learner's values


class IterationPrograms(NamedTuple):
    """What `run_train` builds once and every GRPO iteration calls."""

    grpo_step: Any                   # `make_grpo_step(...)`: one optimizer update
    behaviour_logprobs: Any          # `jit_learner_logprobs(...)`: the old log-probs
    rule: ReplayRule                 # when the recorded log-probs are the replay's
    reference: Reference | None = None
    model_params: Any = None         # train tree -> model params (`optim.weights`), or None
    env_runner: Any = None           # a multi-turn task's `envs.EnvRunner`, or None


def _export(sync, hooks, timer, master):
    """The step's one export: (served, sampler params, sync state); every round of the step
    samples these."""
    with timer("export"):
        served, sampler_params, sync = hooks.export(sync, master)
        jax.block_until_ready(sampler_params)
    return served, sampler_params, sync


def dispatch_rollout(held, version, key, cfg, plan, problems, side: SamplerSide):
    """The rollout of `problems` (G samples each) on `held` (the sampler's copies of the
    weights, `SamplerSide.hold`), dispatched without waiting for it; returns (rollout,
    spec metrics).

    The rollout stays on the sampler's devices (`side.to_learner` moves it).
    """
    g, tok = cfg.grpo, plan.task.tokenizer
    sample_kw = dict(policy=plan.sampler_policy,
                     sampling=SamplingConfig(temperature=g.temperature, draw=g.draw),
                     max_new_tokens=plan.max_new_tokens, num_samples=g.group_size,
                     eos_id=tok.eos_id, pad_id=tok.pad_id, loop=plan.loop,
                     weights_version=version)
    prompts = [plan.task.prompt_ids(p) for p in problems]
    if g.speculative:  # same samples, drafted and verified (`rollout.speculative`); one device
        from jaxrl_lp.rollout.speculative import speculative_generate

        ro, st = speculative_generate(held.copies[0], plan.model, prompts, g.speculative,
                                      with_stats=True, key=key, mesh=side.sampler_mesh,
                                      **sample_kw)
        return ro, {"spec_acceptance": st.acceptance_rate,
                    "spec_tokens_per_forward": st.tokens_per_target_forward(
                        ro.prompt_tokens.shape[0])}
    layout = sampler_layout(g, side)
    return side.generate(held, prompts, key=key, record_products=g.reuse_products,
                         decode_layout=layout,
                         invariant_form=g.invariant_form if layout else None, **sample_kw), {}


def sampler_layout(g, side: SamplerSide) -> str | None:
    """The sampler's decode layout: `invariant` for `grpo.logprobs=invariant` where its forms
    hold (`numerics.invariant.unsupported`, `grpo.invariant_tiles`' fixed tiles where they are
    asked for), else None (`generate` picks)."""
    if g.logprobs != "invariant" or invariant_unsupported(
            mesh=side.sampler_mesh, form=g.invariant_form) is not None:
        return None
    return "invariant"


def _sample(weights, step, key, cfg, plan, problems, timer, side: SamplerSide):
    """`dispatch_rollout`, waited for and moved to the learner: (rollout, spec metrics)."""
    with timer("sample"):
        ro, spec = dispatch_rollout(weights, step, key, cfg, plan, problems, side)
        ro = side.to_learner(jax.block_until_ready(ro))
    return ro, spec


def sample_step_episodes(params, version, key, cfg, plan, problems, runner, timer=None):
    """A multi-turn task's episodes (`train.episodes`) of `problems`, G each, on `params`
    (exported at step `version`), the environments stepped by `runner`; timed as `sample`
    by `timer` when given."""
    from jaxrl_lp.train.episodes import sample_episodes

    g = cfg.grpo
    with timer("sample") if timer is not None else contextlib.nullcontext():
        mt = sample_episodes(params, plan.model, plan.task, problems, group_size=g.group_size,
                             policy=plan.sampler_policy,
                             sampling=SamplingConfig(temperature=g.temperature, draw=g.draw),
                             loop=plan.loop, key=key, runner=runner, weights_version=version)
    return mt


class _Round(NamedTuple):
    """One sampled batch of prompts (a dynamic-sampling step may draw several)."""

    ro: Any                          # its Rollout, as sampled (B rows)
    rewards: np.ndarray              # [B] the task's rewards
    penalty: np.ndarray              # [B] the overlong penalty (<= 0), zeros when off
    scored: Any = None               # the task's `tasks.RewardBatch` (each reward
                                     # function's values), or None: its rewards alone


def _episode_round(mt) -> _Round:
    """A multi-turn call as a round: the environments' rewards, each episode's sum over its
    turns (no overlong penalty: episodes end by their turn limits)."""
    return _Round(mt.rollout, mt.rewards.astype(np.float32),
                  np.zeros(len(mt.rewards), np.float32))


def _score(ro, problems, cfg, plan, timer) -> tuple[np.ndarray, np.ndarray, Any]:
    """(task rewards, overlong penalty) of a rollout, [B] f32 host arrays each, and the
    task's `RewardBatch` where it gave one (else None)."""
    g = cfg.grpo
    with timer("score"):
        out = plan.task.rewards(to_host(ro.completion_tokens),
                                [p for p in problems for _ in range(g.group_size)])
        scored = out if isinstance(out, RewardBatch) else None
        rewards = np.asarray(out.total_B if scored is not None else out, np.float32)
        penalty = np.zeros_like(rewards)
        if g.overlong_buffer:  # counted in tokens, EOS included (`rl.advantages`)
            penalty = np.asarray(overlong_penalty(to_host(ro.completion_mask).sum(1),
                                                  plan.max_new_tokens, g.overlong_buffer,
                                                  g.overlong_penalty))
    return rewards, penalty, scored


def _reward_metrics(rounds: list[_Round]) -> dict[str, float]:
    """`reward/<name>` (the mean of each reward function's values over every sample of the
    step's rounds, samples it does not apply to left out) and `reward_failed/<name>`."""
    batches = [r.scored for r in rounds if r.scored is not None]
    if not batches:
        return {}
    out = {}
    for name in batches[0].parts:
        values = np.concatenate([b.parts[name] for b in batches])
        out[f"reward/{name}"] = float(np.nanmean(values)) if np.isfinite(values).any() else 0.0
        out[f"reward_failed/{name}"] = float(sum(b.failed.get(name, 0) for b in batches))
    return out


def _shaped(rewards: np.ndarray, penalty: np.ndarray) -> np.ndarray:
    """The rewards the advantages see: the task's plus the overlong penalty."""
    # No addition without a penalty: the default run's rewards are the task's, bit for bit.
    return rewards + penalty if penalty.any() else rewards


def grpo_iteration(state: RunState, step: int, cfg, plan, programs: IterationPrograms,
                   prompt_it, hooks: SyncHooks, queue: RolloutQueue | None = None
                   ) -> tuple[RunState, dict]:
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
    side = sampler_side(plan)
    # What the step updates: each update's params and GRPO optimizer state, the sync state.
    params, opt_grpo = state.params, state.opt_grpo
    master = view(params)
    if queue is None:
        problems = [task.train[int(i)] for i in prompt_it.next_global()]
    key = sampling_key(cfg.run.seed, step)
    served, sampler_params, sync = _export(state.sync, hooks, timer, master)
    episodes = None  # a multi-turn task's `MultiTurnRollout`
    if queue is None and programs.env_runner is not None:  # episodes (`train.episodes`)
        rollout_weights = side.hold(sampler_params, copy=False)
        episodes = sample_step_episodes(sampler_params, step, key, cfg, plan, problems,
                                        programs.env_runner, timer)
        ro, spec_metrics = episodes.rollout, {}
    elif queue is None:  # synchronous: this step's rollout, on this step's export
        rollout_weights = side.hold(sampler_params, copy=False)
        ro, spec_metrics = _sample(rollout_weights, step, key, cfg, plan, problems, timer, side)
    else:  # off-policy: dispatch step + K's rollout on this export, learn from step's
        with timer("sample"):
            queue.fill(step, side.hold(sampler_params, copy=True))
            entry, rollout_weights = queue.pop(step)
            if programs.env_runner is not None:  # a call of episodes, on the learner's devices
                episodes = entry.rollout
                ro = episodes.rollout
            else:
                ro = side.to_learner(jax.block_until_ready(entry.rollout))
        problems, spec_metrics = [task.train[i] for i in entry.problems], dict(entry.spec_metrics)
    version = int(ro.weights_version)  # the export the rollout was sampled on
    # The sampler's weight products (`grpo.reuse_products`) go to the updates that compute
    # with the weights that made them, and nowhere else.
    products, ro = ro.products, dataclasses.replace(ro, products=None)
    if episodes is None:
        rounds = [_Round(ro, *_score(ro, problems, cfg, plan, timer))]
    else:  # the environments' rewards, each episode's sum over its turns
        rounds = [_episode_round(episodes)]
    episode_calls = [episodes]  # a multi-turn task's calls of episodes, one per round
    ds_metrics, picked = {}, None
    if g.dynamic_sampling:
        def draw(r):  # round r >= 1: the next prompts of the run's stream, a key of their own
            if r and episodes is not None:  # sampled on the weights of round 0
                more = [task.train[int(i)] for i in prompt_it.next_global()]
                episode_calls.append(sample_step_episodes(
                    rollout_weights.copies[0], version, jax.random.fold_in(key, r), cfg, plan,
                    more, programs.env_runner, timer))
                rounds.append(_episode_round(episode_calls[-1]))
            elif r:  # sampled on the weights of the step's first round
                more = [task.train[int(i)] for i in prompt_it.next_global()]
                ro_r, sm = _sample(rollout_weights, version, jax.random.fold_in(key, r), cfg,
                                   plan, more, timer, side)
                ro_r = dataclasses.replace(ro_r, products=None)  # a refilled batch: computed
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
            products = None
            if picked.masked_groups:  # the bound was hit: these groups leave the loss
                ro = dataclasses.replace(ro, completion_mask=ro.completion_mask * jnp.asarray(
                    1.0 - picked.masked_B[:, None], ro.completion_mask.dtype))
        ds_metrics = dict(refill_rounds=picked.refill_rounds,
                          refilled_groups=picked.refilled_groups,
                          masked_groups=picked.masked_groups,
                          informative_groups=g.prompts_per_step - picked.masked_groups)
    # A multi-turn step's calls of episodes and the rows taken from each (None: all).
    episode_parts = None if episodes is None else (
        [(episodes, None)] if picked is None or picked.single_round else
        [(mt, rows) for mt, rows in zip(episode_calls, picked.rows, strict=True) if len(rows)])
    with timer("score"):
        if picked is None or picked.single_round:
            raw, penalty = rounds[0].rewards, rounds[0].penalty
        else:
            raw, penalty = (np.concatenate([getattr(rnd, f)[rows] for rnd, rows in parts])
                            for f in ("rewards", "penalty"))
        shaped = _shaped(raw, penalty)
        if episodes is not None and g.turn_credit == "reward_to_go":  # per token, by turn
            from jaxrl_lp.train.episodes import turn_credit_advantages

            adv = turn_credit_advantages(episode_parts, g.group_size, g.advantage,
                                         g.turn_discount, ro.completion_tokens.shape[1])
        else:
            adv = np.asarray(group_advantages(jnp.asarray(shaped), g.group_size,
                                              kind=g.advantage))
        n_zero_var = (picked.zero_variance_groups if picked is not None else
                      int(np.asarray(zero_variance_groups(jnp.asarray(shaped),
                                                          g.group_size)).sum()))
    on_served = hooks.active and cfg.sync.loss_on_served
    rule, old_logp_fn = programs.rule, programs.behaviour_logprobs
    if episodes is not None and g.logprobs == "hybrid":
        # A multi-turn rollout's replay is its own programs' (`rollout.multiturn`), each
        # call's whole batch at once; the dense log-probs read it as any rollout.
        from jaxrl_lp.train.episodes import replay_episodes

        old_logp_fn = lambda p, _ro: replay_episodes(p, plan.model, plan.learner_policy,
                                                      episode_parts)
        if programs.reference is not None:  # the reference's values: the same replay
            programs = programs._replace(
                reference=programs.reference._replace(logprobs=old_logp_fn))
    # The weights the loss computes with: the served copy (constant over the step's updates)
    # or the master (moved by each update).
    loss_weights = (lambda: sampler_params) if on_served else (lambda: view(params))
    grpo_step_n = step - cfg.sft.steps
    verify = bool(g.verify_every) and grpo_step_n % g.verify_every == 0
    stale = version != step  # sampled on an earlier export (`grpo.max_staleness`)
    numerics = None  # the sampler-vs-learner mismatch at the rollout's own weights, if measured
    with timer("behaviour"):
        recorded = rule.recorded(ro, loss_weights())
        if recorded and not verify:
            old_logp = ro.logprobs  # the replay's values: nothing to compute
        elif recorded:  # a verification: the replay (the sampler's own program, each row in
            # its call: `rollout.replay`) must be the recorded bits
            old_logp = jax.block_until_ready(
                old_logp_fn(sampler_params if on_served else master, ro))
            check_replay_equal(old_logp, ro, step, g.logprobs)
        else:  # the behaviour log-probs as the learner computes them (on the copy the loss uses)
            old_logp = jax.block_until_ready(
                old_logp_fn(sampler_params if on_served else master, ro))
            if stale and verify:  # the numerics alone: the learner at the rollout's own weights
                at_own = jax.block_until_ready(
                    old_logp_fn(side.params_to_learner(rollout_weights), ro))
                if rule.can_reuse:  # the replay at the rollout's weights: its bits
                    check_replay_equal(at_own, ro, step, g.logprobs)
                numerics = {k: float(v) for k, v in mismatch_metrics(
                    at_own, ro.logprobs, ro.completion_mask).items()}
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
            # The served copy's log-probs: the rollout's own unless it was sampled on an
            # earlier export (then the served copy's of this one, computed).
            served_ro = ro if not stale or recorded else dataclasses.replace(
                ro, logprobs=old_logp if on_served else old_logp_fn(sampler_params, ro))
            sync, sync_metrics = hooks.diagnostics(sync, master, served, served_ro, master_logp)
            k = cfg.sync.check_every
            if k and grpo_step_n % k == 0:
                tok = task.tokenizer
                probe = pad_prompts([task.prompt_ids(task.heldout[i]) for i in range(4)],
                                    tok.pad_id, bucket=False)[0]
                sync_metrics.update(hooks.check(step, master, served, jnp.asarray(probe)))
            sync_metrics = {k: float(v) for k, v in sync_metrics.items()}
    # Where the behaviour log-probs are the replay under the weights an update computes with
    # (its first, or each on the served copy the updates do not move), they are its value.
    behaviour_value = (g.replay == "auto" and g.logprobs == "hybrid" and not recorded
                       and programs.model_params is None)
    n = shaped.shape[0]
    size = n // g.minibatches
    sums: dict[str, float] = {}
    replayed = reused_forward = 0
    with timer("update"):
        for epoch in range(g.mu):
            for i in range(g.minibatches):
                idx = np.arange(i * size, (i + 1) * size)
                # Per update: the first computes with the sampler's weights, a later one
                # with the weights the updates before it made (unless the loss is on the
                # served copy, which the updates do not move).
                first = epoch == 0 and i == 0
                reuse = recorded if first or on_served else rule.recorded(ro, loss_weights())
                # None: the step computes it (the hybrid's replay, the invariant forward).
                value = (ro.logprobs[idx] if reuse else
                         old_logp[idx] if behaviour_value and (first or on_served) else None)
                replayed += int(g.logprobs == "hybrid" and value is None)
                if value is None and episodes is not None and g.logprobs == "hybrid":
                    value = old_logp_fn(loss_weights(), ro)[idx]  # this update's weights
                # The sampler's products stand for this update's forward where its recorded
                # log-probs are the replay's: the same weights and numerics.
                prods = take_product_rows(products, idx) if reuse and products is not None \
                    else None
                reused_forward += int(prods is not None)
                params, opt_grpo, m = programs.grpo_step(
                    params, opt_grpo, take_rows(ro, idx),
                    jnp.asarray(adv[idx]), old_logp[idx],
                    None if ref_logp is None else ref_logp[idx],
                    sampler_params if on_served else None, value, prods)
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
    updates = g.mu * g.minibatches
    metrics = {k: v / updates for k, v in sums.items() if not k.startswith("mismatch_")}
    step_mismatch = {k: v / updates for k, v in sums.items() if k.startswith("mismatch_")}
    if not stale:  # the step's mismatch is the numerics' (where it was measured)
        metrics.update(step_mismatch if measured else {})
    else:  # it measures the current policy against the behaviour one: the policy change too
        metrics.update({k.replace("mismatch_", "offpolicy_"): v for k, v in step_mismatch.items()})
        numerics = step_mismatch if recorded and verify else numerics
        metrics.update(numerics or {})
    metrics["skipped"] = float(sums.get("skipped", 0.0) > 0)
    if episodes is not None:
        from jaxrl_lp.train.episodes import episode_metrics

        metrics.update(episode_metrics(*episode_calls))  # every episode sampled, refills too
    metrics.update(sync_metrics)
    metrics.update(spec_metrics)
    metrics.update(ds_metrics)
    metrics.update(_reward_metrics(rounds))
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
        reused_forward_updates=float(reused_forward),
        replay_verified=float(verify and (recorded or (stale and rule.can_reuse))),
        rollout_staleness=float(step - version), **t,
    )
    return dataclasses.replace(state, params=params, opt_grpo=opt_grpo, sync=sync), metrics
