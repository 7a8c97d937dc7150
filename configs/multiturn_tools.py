"""Multi-turn GRPO with a calculator tool, on CPU in minutes: 3-digit by 2-digit multiplication.

A small dense model learns from a warm-start whose episodes call the calculator on 30% of
the problems and answer at once on the rest (`envs.CalculatorTask`); it cannot multiply in
one pass, so GRPO's episodes raise the tool-use rate, and with it the solve rate. Every
rollout is replayed bit for bit on the verification steps (`rollout.multiturn`).

    jaxrl-lp train --config configs/multiturn_tools.py
"""

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.rl.loss import LossConfig
from jaxrl_lp.train.config import GRPOConfig, RunConfig, SFTConfig, TaskConfig, TrainConfig

CONFIG = TrainConfig(
    model=ModelConfig(
        family="qwen3", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=192, qk_norm=True, loop_steps=1, max_position_embeddings=64,
        rope_theta=10_000.0,
    ),
    task=TaskConfig(kind="calculator", ops="*", max_digits=3, second_digits=2, max_turns=3,
                    tool_fraction=0.3),
    sft=SFTConfig(steps=600, batch_size=64, lr=3e-3),
    grpo=GRPOConfig(steps=40, prompts_per_step=16, group_size=8, lr=3e-4, verify_every=5),
    loss=LossConfig(),
    run=RunConfig(out_dir="runs/multiturn_tools", eval_every=10, eval_size=128,
                  checkpoint_every=20),
)
