"""The training program's optimizers, from its config (`make_optimizers`).

`train.validate` builds them into the `RunPlan`, the planner prices their
state, and `train.program` runs them.
"""

from __future__ import annotations

import optax

from jaxrl_lp.train.config import TrainConfig

__all__ = ["make_optimizers"]


def make_optimizers(cfg: TrainConfig) -> tuple[optax.GradientTransformation,
                                               optax.GradientTransformation]:
    """The warm-start optimizer (AdamW, warmup + cosine) and the GRPO one (clipped Adam).

    With `sft.optimizer=error_diffusion:...` the codes are trained by error
    diffusion beside them (`OptimizerSpec.transform`): in the warm-start its
    step follows the AdamW schedule's shape, in GRPO it is scaled by
    `grpo.lr / sft.lr`; `latent_ste` uses these optimizers on its latents.
    """
    from jaxrl_lp.optim import OptimizerSpec

    s = cfg.sft
    warmup = max(1, min(s.warmup_steps, s.steps // 2))
    schedule = optax.warmup_cosine_decay_schedule(0.0, s.lr, warmup, max(warmup + 1, s.steps))
    sft = optax.adamw(schedule, weight_decay=0.0)
    grpo_adam = optax.adam(cfg.grpo.lr)
    spec = OptimizerSpec.parse(s.optimizer, "sft.optimizer")
    if spec.kind == "error_diffusion":
        sft = spec.transform(sft, lambda c: schedule(c) / s.lr, seed=cfg.run.seed)
        grpo_adam = spec.transform(grpo_adam, cfg.grpo.lr / s.lr, seed=cfg.run.seed + 1)
    grpo = optax.chain(optax.clip_by_global_norm(1.0), grpo_adam)
    return sft, grpo
