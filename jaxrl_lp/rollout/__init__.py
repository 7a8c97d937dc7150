"""The sampler: prefill and a jitted while-loop decode, dense and looped (dense/deferred);
speculative rollouts (`speculative_generate`); multi-turn episodes with environments
(`generate_multiturn`, replayed bit for bit by `replay_multiturn`)."""

from jaxrl_lp.rollout.generate import Rollout, generate
from jaxrl_lp.rollout.multiturn import (
    MultiTurnRollout,
    TurnLimits,
    TurnOutcome,
    generate_multiturn,
    replay_multiturn,
)
from jaxrl_lp.rollout.request import Request, bucket_length, check_request, pad_prompts
from jaxrl_lp.rollout.sampling import SamplingConfig, sample_tokens, token_logprobs
from jaxrl_lp.rollout.spec_config import SpecConfig
from jaxrl_lp.rollout.speculative import SpecStats, speculative_generate
from jaxrl_lp.rollout.step import LoopSpec, decode_step, prefill

__all__ = [
    "LoopSpec",
    "MultiTurnRollout",
    "Request",
    "Rollout",
    "SamplingConfig",
    "SpecConfig",
    "SpecStats",
    "TurnLimits",
    "TurnOutcome",
    "bucket_length",
    "check_request",
    "decode_step",
    "generate",
    "generate_multiturn",
    "pad_prompts",
    "prefill",
    "replay_multiturn",
    "sample_tokens",
    "speculative_generate",
    "token_logprobs",
]
