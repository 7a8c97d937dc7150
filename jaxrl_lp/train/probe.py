"""The start probe: a run checks replay == sampler on its own platform before it writes anything.

A run with `grpo.replay=auto`, hybrid log-probs and matched policies takes
the sampler's recorded log-probs as the learner's values, which is right
only where the replay of a batch is the sampler's bits. The replay is built
to be (`rollout.replay`: the sampler's own executable, each row in its
place), but that rests on the platform keeping a row's values independent
of the other rows; a platform, a JAX version or a kernel that breaks it
would make every update silently wrong. So before the run directory is
created, `probe_exactness` samples one batch at the run's shapes (its
prompts per step and group size, its completion budget, policy, loop spec
and temperature) where the run's sampler runs (its mesh, or its replicas),
replays it on the learner's side whole and in the slices the run replays (a
minibatch, a micro-batch), and compares the bits. The sampler's
program it compiles is the one the run then uses.

A multi-turn task's run is probed with what its GRPO steps run: one call of
episodes at its shapes (`train.episodes.sample_episodes`, its environments
stepped as the run steps them), on the learner's devices, replayed whole by
the episodes' programs (`rollout.multiturn.replay_multiturn`): its updates
replay whole calls and take their rows, so there is no slice to check.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxrl_lp.envs import EnvRunner
from jaxrl_lp.models.model import init_params
from jaxrl_lp.parallel.rules import param_shardings
from jaxrl_lp.parallel.shard import put_tree, to_host
from jaxrl_lp.rl.logprob_programs import jit_learner_logprobs
from jaxrl_lp.rollout.generate import take_rows
from jaxrl_lp.rollout.multiturn import replay_multiturn
from jaxrl_lp.rollout.replay import replay_logprobs
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.train.behaviour import bit_mismatch
from jaxrl_lp.train.episodes import is_multiturn, sample_episodes
from jaxrl_lp.train.grpo_iteration import sampler_layout, sampler_side

__all__ = ["ExactnessProbeError", "probe_exactness"]


class ExactnessProbeError(ValueError):
    """The start probe found a replay that differs from the sampler (one line: what, and the
    settings that run anyway)."""


def _slices(rows: int, minibatches: int, micro_batches: int) -> list[int]:
    """The row counts the run replays apart from the whole batch: a minibatch, a micro-batch."""
    sizes = {rows // minibatches, rows // (minibatches * micro_batches)}
    return sorted((s for s in sizes if 0 < s < rows), reverse=True)


def probe_exactness(cfg, plan) -> dict | None:
    """Samples and replays one batch at the run's shapes; raises where a bit differs.

    Returns None where the run does not take recorded log-probs as the
    replay's (`grpo.replay=always`, dense log-probs, unmatched policies) or
    `grpo.start_probe` is false; else what was checked: `{"rows": B,
    "slices": [...], "tokens": n}`. A multi-turn task's call of episodes is checked
    whole (its updates replay whole calls); a speculative sampler's batch, whole and in
    the slices, as a plain one's. With `grpo.logprobs=invariant` the batch is sampled in
    the `invariant` decode layout and checked by the learner's invariant forward (the
    program its verifications run), whole and in the slices.

    Raises:
      ExactnessProbeError: the replay of the whole batch or of a slice differs
        from the sampler's recorded log-probs.
    """
    g = cfg.grpo
    relies = (g.replay == "auto" and g.logprobs in ("hybrid", "invariant")
              and plan.learner_policy == plan.sampler_policy)
    if not (g.start_probe and relies):
        return None
    task, tok = plan.task, plan.task.tokenizer
    params = init_params(plan.model, jax.random.PRNGKey(cfg.run.seed))
    if is_multiturn(task):
        return _probe_episodes(cfg, plan, params)
    side = sampler_side(plan)  # where the run's sampler runs, as it holds its weights
    prompts = [task.prompt_ids(task.train[i % len(task.train)])
               for i in range(g.prompts_per_step)]
    kw = dict(policy=plan.sampler_policy,
              sampling=SamplingConfig(temperature=g.temperature, draw=g.draw),
              max_new_tokens=plan.max_new_tokens, num_samples=g.group_size, eos_id=tok.eos_id,
              pad_id=tok.pad_id, loop=plan.loop, key=jax.random.PRNGKey(cfg.run.seed))
    if g.speculative:
        from jaxrl_lp.rollout.speculative import speculative_generate

        ro = speculative_generate(params, plan.model, prompts, g.speculative, **kw)
    else:
        ro = side.to_learner(jax.block_until_ready(side.generate(
            side.hold(params, copy=False), prompts, decode_layout=(layout := sampler_layout(
                g, side)), invariant_form=g.invariant_form if layout else None, **kw)))
    mesh = plan.mesh  # the learner's: a rollout's calls replay where they ran
    want = np.asarray(to_host(ro.logprobs), np.float32)
    mask = np.asarray(to_host(ro.completion_mask)) > 0
    rows = want.shape[0]
    # `invariant`: the learner's parallel forward in the invariant forms, the program its
    # verifications run (the replay where the forms are not proven here).
    learner = (jit_learner_logprobs(plan.model, plan.learner_policy, "invariant", loop=plan.loop,
                                    mesh=mesh, form=g.invariant_form)
               if g.logprobs == "invariant" else
               lambda p, r: replay_logprobs(p, plan.model, plan.learner_policy, r, mesh=mesh))
    replay = lambda r: np.asarray(to_host(learner(params, r)), np.float32)
    slices = _slices(rows, g.minibatches, g.micro_batches)
    for size in [rows, *slices]:
        got = np.concatenate([replay(ro if size == rows else
                                     take_rows(ro, np.arange(i, i + size)))
                              for i in range(0, rows, size)])
        _compare(got, want, mask, "the whole batch" if size == rows else f"slices of {size} rows",
                 g.logprobs)
    return {"rows": rows, "slices": slices, "tokens": int(mask.sum())}


def _compare(got, want, mask, shape: str, method: str = "hybrid") -> None:
    """Raises `ExactnessProbeError` where a replayed value under `mask` is not the sampler's
    bits (`shape`: what was replayed, for the message; `method`: the learner's)."""
    differ, tokens, worst = bit_mismatch(got, want, mask)
    if differ and method == "invariant":
        raise ExactnessProbeError(
            f"grpo.start_probe: on {jax.default_backend()} the learner's invariant forward of "
            f"{shape} differs from the sampler on {differ} of {tokens} tokens (max |dlogp| "
            f"{worst:.3g}), so its log-probs are not the sampler's; nothing was written. Set "
            "grpo.logprobs=hybrid (the updates replay the decode) or grpo.start_probe=false "
            "to run as configured")
    if differ:
        raise ExactnessProbeError(
            f"grpo.start_probe: on {jax.default_backend()} the learner's replay of "
            f"{shape} differs from the sampler on {differ} of {tokens} "
            f"tokens (max |dlogp| {worst:.3g}), so the sampler's log-probs cannot stand for "
            "the learner's; nothing was written. Set grpo.replay=always (every update "
            "replays; the mismatch metrics measure it), or grpo.logprobs=dense, or "
            "grpo.start_probe=false to run as configured")


def _probe_episodes(cfg, plan, params) -> dict:
    """A multi-turn run's probe (module docstring): one call of episodes, replayed whole."""
    g, task = cfg.grpo, plan.task
    if plan.mesh is not None:  # the episodes' programs as the run compiles them: sharded
        params = put_tree(params, param_shardings(params, plan.model, plan.mesh))
    runner = EnvRunner(timeout_s=cfg.task.env_timeout_s, failure_reward=cfg.task.failure_reward)
    try:
        mt = sample_episodes(params, plan.model, task,
                             [task.train[i % len(task.train)] for i in range(g.prompts_per_step)],
                             group_size=g.group_size, policy=plan.sampler_policy,
                             sampling=SamplingConfig(temperature=g.temperature, draw=g.draw),
                             loop=plan.loop, key=jax.random.PRNGKey(cfg.run.seed), runner=runner)
    finally:
        runner.close()
    ro = mt.rollout
    _compare(replay_multiturn(params, plan.model, plan.learner_policy, mt), ro.logprobs,
             ro.completion_mask, "a call of episodes")
    return {"rows": int(ro.logprobs.shape[0]), "slices": [],
            "tokens": int(np.asarray(to_host(ro.completion_mask)).sum())}


def _reference_completions(task, records) -> np.ndarray | None:
    """[B, N] the records' warm-start completions (EOS-ended, padded), or None where the task
    has none to give."""
    from jaxrl_lp.tasks.protocol import SupervisedTask

    if not isinstance(task, SupervisedTask):
        return None
    try:
        completions = [list(task.sft_example(r)[1]) for r in records]
    except ValueError:  # e.g. a dataset without reference completions
        return None
    n = max(len(c) for c in completions)
    pad = task.tokenizer.pad_id
    return np.asarray([c + [pad] * (n - len(c)) for c in completions], np.int32)


def probe_rewards(cfg, plan, size: int = 8) -> dict | None:
    """Scores the first `size` training records' reference completions (the warm-start's)
    with the task's rewards before anything is written, so a reward function that raises,
    hangs, or returns the wrong number of values or a non-finite one stops the run with one
    line naming it and the record, not hours later.

    A single-turn task's `rewards` is called; a `tasks.DatasetTask`'s reward functions
    strictly (the first failure raises; in the run a failure is the sample's
    `task.failure_reward`, counted). A task without reference completions, or a
    multi-turn task without reward functions, is not probed (returns None).

    Returns:
      `{"rows": B, "reward_mean": ...}` of what was scored, or None.

    Raises:
      ValueError: a reward function failed on a reference completion, or the task's
        `rewards` returned something other than B finite values.
    """
    from jaxrl_lp.tasks.dataset import DatasetTask
    from jaxrl_lp.tasks.protocol import SingleTurnTask, is_multiturn
    from jaxrl_lp.tasks.rewards import RewardBatch

    task = plan.task
    records = [task.train[i] for i in range(min(size, len(task.train)))]
    ids = _reference_completions(task, records)
    if ids is None:
        return None
    if isinstance(task, DatasetTask):
        if not task.reward_functions:
            return None
        from jaxrl_lp.tasks.dataset import completion_texts_of, trimmed_ids_of

        out = task.score_texts(records, completion_texts_of(ids, task.tokenizer),
                               trimmed_ids_of(ids, task.tokenizer), strict=True)
    elif isinstance(task, SingleTurnTask) and not is_multiturn(task):
        try:
            out = task.rewards(ids, records)
        except Exception as e:  # noqa: BLE001 - a user's rewards: named in one line
            raise ValueError(f"task: {type(task).__name__}.rewards raised {type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]} on the reference completions "
                             "of the first training records") from None
    else:
        return None
    total = np.asarray(out.total_B if isinstance(out, RewardBatch) else out, np.float64)
    if total.shape != (len(records),) or not np.isfinite(total).all():
        raise ValueError(f"task: {type(task).__name__}.rewards returned "
                         f"{str(total.tolist())[:80]} (shape {total.shape}) for {len(records)} "
                         "completions; return one finite reward per completion")
    return {"rows": len(records), "reward_mean": float(total.mean())}
