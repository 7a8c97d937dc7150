"""The embedded default run of `jaxrl-lp train`: a small looped model learns arithmetic on CPU."""

from __future__ import annotations

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.rl.loss import LossConfig
from jaxrl_lp.train.config import GRPOConfig, RunConfig, SFTConfig, TaskConfig, TrainConfig

__all__ = ["default_config"]


def default_config() -> TrainConfig:
    """Two-digit addition; a 2-layer, 2-loop Ouro-style model; warm-start then GRPO.

    The warm-start leaves a loss plateau (about 1.3, then about 0.65 nats per
    answer token; by our reading, until the model learns the carry) after a time
    that depends on the seed and on the CPU's rounding (XLA:CPU picks its matmul
    kernels by instruction set). At 64 sequences a step the 1,200 steps escaped
    it on the Zen 5 and Xeon development machines (37.5% to 81.3% after the
    warm-start) and on no seed of three on a 2-core Zen 3 EPYC (0.8% to 6.6%,
    measured as below); at 128 (the default since 2026-12-04) all five seeds
    tried escape there (warm-start loss 0.003 to 0.015). Greedy accuracy on 512
    held-out problems after the warm-start (`jaxrl-lp sft --set run.seed=N`,
    then `jaxrl-lp eval --size 512`), Zen 3, seeds 0-4: 88.3% / 95.7% / 51.2% /
    91.0% / 62.1% with the sampler's read-out (the last loop step), 99.8% to
    100% at `grpo.exit_rule=threshold:0.5`: the warm-start trains the exit-weighted
    read-out, the sampler and GRPO the last step's. The whole run (`jaxrl-lp
    train --set run.seed=N`) on that machine: 87.5% -> 99.6% (seed 0, 3.0
    minutes) and 47.7% -> 95.7% (seed 2).
    GRPO: 60 steps at Adam 1e-4 (at 3e-4 an earlier model peaked and fell back;
    at 1e-3 the policy collapsed in 4 steps).
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
