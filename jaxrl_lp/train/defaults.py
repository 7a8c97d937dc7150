"""The embedded default run of `jaxrl-lp train`: a small looped model learns arithmetic on CPU."""

from __future__ import annotations

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.rl.loss import LossConfig
from jaxrl_lp.train.config import GRPOConfig, RunConfig, SFTConfig, TaskConfig, TrainConfig

__all__ = ["default_config"]


def default_config() -> TrainConfig:
    """Two-digit addition; a 2-layer, 2-loop Ouro-style model; warm-start then GRPO.

    The warm-start (1,200 steps of 128 sequences at Adam 3e-3) is sized to
    leave its loss plateau (about 1.3, then 0.65 nats per answer token) on
    every CPU the project runs on, whose rounding decides how long it
    stays there; GRPO takes 60 steps at Adam 1e-4. The measurements behind both
    choices, by machine and seed: docs/design/warm_start.md, "The default warm-start".
    """
    return TrainConfig(
        model=ModelConfig(
            family="ouro", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, intermediate_size=192, qk_norm=False, loop_steps=2,
            max_position_embeddings=64, rope_theta=10_000.0,
        ),
        task=TaskConfig(kind="arithmetic", ops="+", max_digits=2, reverse_answer=True,
                        pad_operands=True),
        sft=SFTConfig(steps=1200, batch_size=128, lr=3e-3),
        grpo=GRPOConfig(steps=60, prompts_per_step=32, group_size=8, lr=1e-4),
        loss=LossConfig(),
        run=RunConfig(out_dir="runs/default", eval_every=10, eval_size=256, checkpoint_every=20),
    )
