"""Our GRPO iteration as the training program runs it (`train.grpo_iteration`), without
exporter or sync checks: what `jaxrl-lp bench iteration` (`bench.iteration`) races against
Tunix's, one iteration a call, with its phase seconds and the FLOPs of what it ran."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.bench.learner import LOSS, PAD_ID
from jaxrl_lp.models.recorded import take_product_rows
from jaxrl_lp.plan.hlo_cost import hlo_cost
from jaxrl_lp.rl.advantages import group_advantages
from jaxrl_lp.rl.logprob_programs import jit_learner_logprobs
from jaxrl_lp.rl.train_step import make_grpo_step
from jaxrl_lp.rollout import SamplingConfig, generate
from jaxrl_lp.rollout.generate import take_rows
from jaxrl_lp.rollout.replay import traced_replay_logprobs
from jaxrl_lp.train.behaviour import PhaseTimer, ReplayRule

__all__ = ["OurIteration", "reward"]


def _xla_flops(compiled) -> float:
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return float(ca.get("flops", 0.0))


def reward(completion_BxN: np.ndarray) -> np.ndarray:
    """The toy reward both sides use: the fraction of even token ids in a completion."""
    return (np.asarray(completion_BxN) % 2 == 0).mean(axis=1).astype(np.float32)


class OurIteration:
    """Our GRPO iteration, as `train.grpo_iteration` runs it without exporter or sync checks.

    Each call runs one iteration on the state it holds (the weights move) and
    returns its phase seconds (`PhaseTimer.metrics`) plus what it did.
    """

    def __init__(self, cfg, policy, params, prompts, optimizer, *, method, group, new_tokens,
                 minibatches, loop, pack_buckets, seed, draw="gumbel", layout=None,
                 form=None):
        self.cfg, self.policy, self.prompts, self.draw = cfg, policy, prompts, draw
        # The sampler's decode layout (None: `generate` picks it; `invariant`'s its own).
        self.layout = "invariant" if method == "invariant" else layout
        # `invariant`'s form: fixed tiles where `--invariant-tiles` names them, else this CPU's.
        self.form = form if method == "invariant" else None
        self.group, self.new_tokens, self.minibatches = group, new_tokens, minibatches
        self.loop, self.seed, self.method = loop, seed, method
        # `products`: the hybrid learner reading the sampler's weight products where it may.
        self.record = method == "products"
        learner = "hybrid" if method in ("products", "traced") else method
        self.step = make_grpo_step(cfg, policy, LOSS, optimizer, method=learner,
                                   pack_buckets=pack_buckets, invariant_form=self.form)
        # `traced`: a replaying update's value from the steps traced at its rows' shape.
        self.traced = (jax.jit(traced_replay_logprobs, static_argnums=(1, 2))
                       if method == "traced" else None)
        # The training program's behaviour program (`run_train`): the learner's values in
        # `minibatches` slices, and the whole-batch replay of a verification.
        self.behaviour = jit_learner_logprobs(cfg, policy, learner, micro_batches=minibatches,
                                              form=self.form)
        self.verify = jit_learner_logprobs(cfg, policy, learner, form=self.form)
        self.rule = ReplayRule("auto", learner, matched=True)
        self.params = jax.tree.map(jnp.copy, params)
        self.opt = optimizer.init(params)
        self.count = 0
        self.last_rollout = None
        self.last_updates = []  # (rows, reuse) of each update of the last iteration

    def __call__(self) -> dict:
        timer, i = PhaseTimer(), self.count
        self.count += 1
        with timer("sample"):
            ro = jax.block_until_ready(generate(
                self.params, self.cfg, self.prompts, policy=self.policy,
                sampling=SamplingConfig(temperature=1.0, draw=self.draw),
                max_new_tokens=self.new_tokens,
                num_samples=self.group, eos_id=None, pad_id=PAD_ID, loop=self.loop,
                key=jax.random.fold_in(jax.random.PRNGKey(self.seed), i), weights_version=i,
                record_products=self.record, decode_layout=self.layout,
                invariant_form=self.form))
            products, ro = ro.products, dataclasses.replace(ro, products=None)
        with timer("score"):
            rewards = reward(jax.device_get(ro.completion_tokens))
            adv = np.asarray(group_advantages(jnp.asarray(rewards), self.group))
        with timer("behaviour"):
            recorded = self.rule.recorded(ro, self.params)
            old_logp = ro.logprobs if recorded else jax.block_until_ready(
                self.behaviour(self.params, ro))
        size, replayed, reused = len(rewards) // self.minibatches, 0, 0
        self.last_updates = []
        with timer("update"):
            for k in range(self.minibatches):
                idx = np.arange(k * size, (k + 1) * size)
                reuse = recorded if k == 0 else self.rule.recorded(ro, self.params)
                replayed += int(self.method not in ("dense", "invariant") and not reuse)
                reused += int(reuse and products is not None)
                self.last_updates.append((idx, reuse))
                self.params, self.opt, m = self.step(*self._update_args(ro, products, idx, reuse,
                                                                        adv, old_logp))
            jax.block_until_ready(m["loss"])
        self.last_rollout, self.last_products = ro, products
        self.last_adv, self.last_old_logp = adv, old_logp
        return {**timer.metrics(), "decode_layout": ro.decode_layout, "replayed_updates": replayed,
                "behaviour_recomputed": int(not recorded), "reused_forward_updates": reused}

    def _update_args(self, ro, products, idx, reuse, adv, old_logp, run=True) -> tuple:
        """The GRPO step's arguments for the update of rows `idx` (`train.grpo_iteration`'s);
        `run` False: for lowering (a replaying update's value left to the step to trace)."""
        rows = take_rows(ro, idx)
        # `invariant` without a recorded value: the step computes it by the invariant forward,
        # a program of its own; lowered, the update's program reads a value of that shape.
        value = ro.logprobs[idx] if reuse or (self.method == "invariant" and not run) else None
        if value is None and self.traced is not None and run:
            value = self.traced(self.params, self.cfg, self.policy, rows)
        return (self.params, self.opt, rows, jnp.asarray(adv[idx]), old_logp[idx], None, None,
                value, take_product_rows(products, idx) if reuse and products is not None else None)

    def compiled_flops(self) -> dict:
        """The loop-aware FLOPs (`plan.hlo_cost`) of the programs the last iteration ran.

        `updates`: per update, its program's FLOPs and whether it replayed;
        `behaviour`: the behaviour program's where it ran (0 otherwise); `xla_updates`:
        XLA's own count of the same programs (a scanned layer counted once). The
        programs are jit's, compiled already.
        """
        ro, flops, xla, memo = self.last_rollout, [], [], {}
        for idx, reuse in self.last_updates:
            args = self._update_args(ro, self.last_products, idx, reuse, self.last_adv,
                                     self.last_old_logp, run=False)
            if reuse not in memo:
                compiled = self.step.lower(*args).compile()
                memo[reuse] = (hlo_cost(compiled.as_text()).flops, _xla_flops(compiled))
            flops.append(memo[reuse][0])
            xla.append(memo[reuse][1])
        behaviour = 0.0
        if self.method == "dense":  # its behaviour forward runs every iteration
            behaviour = hlo_cost(self.behaviour.lower(self.params, ro).compile().as_text()).flops
        return {"updates": flops, "replays": [self.method not in ("dense", "invariant") and not r
                                              for _, r in self.last_updates],
                "behaviour": behaviour, "xla_updates": xla}

    def verify_seconds(self) -> float:
        """Seconds of the whole-batch replay a `grpo.verify_every` step adds (compiled first)."""
        ro = self.last_rollout
        jax.block_until_ready(self.verify(self.params, ro))
        t = PhaseTimer()
        with t("verify"):
            jax.block_until_ready(self.verify(self.params, ro))
        return t.seconds["verify"]
