"""The learner: log-probs (dense, replay, hybrid), GRPO maths and the jitted train steps."""

from jaxrl_lp.rl.advantages import (
    group_advantages,
    overlong_penalty,
    select_groups,
    zero_variance_groups,
)
from jaxrl_lp.rl.corrections import correction_weights
from jaxrl_lp.rl.dynamic_sampling import RefilledBatch, refill_groups
from jaxrl_lp.rl.learner_step import LearnerStep
from jaxrl_lp.rl.logprob_programs import LogprobProgram, jit_learner_logprobs
from jaxrl_lp.rl.logprobs import (
    dense_logprobs,
    forward_products,
    learner_logprobs,
    packed_rows_of,
    recorded_logprobs,
    replay_logprobs,
    traced_replay_logprobs,
)
from jaxrl_lp.rl.loss import LossConfig, kl_penalty, loss_denominator, policy_loss, select_anchor
from jaxrl_lp.rl.metrics import mismatch_metrics
from jaxrl_lp.rl.train_step import make_grpo_step, make_sft_step

__all__ = [
    "LearnerStep",
    "LogprobProgram",
    "LossConfig",
    "RefilledBatch",
    "correction_weights",
    "dense_logprobs",
    "forward_products",
    "group_advantages",
    "jit_learner_logprobs",
    "kl_penalty",
    "learner_logprobs",
    "loss_denominator",
    "make_grpo_step",
    "make_sft_step",
    "mismatch_metrics",
    "overlong_penalty",
    "packed_rows_of",
    "policy_loss",
    "recorded_logprobs",
    "refill_groups",
    "replay_logprobs",
    "select_anchor",
    "select_groups",
    "traced_replay_logprobs",
    "zero_variance_groups",
]
