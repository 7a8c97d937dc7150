"""The sampler: prefill and a jitted while-loop decode, dense and looped (dense/deferred);
speculative rollouts (`speculative_generate`)."""

from jaxrl_lp.rollout.generate import Rollout, generate
from jaxrl_lp.rollout.request import Request, bucket_length, check_request, pad_prompts
from jaxrl_lp.rollout.sampling import SamplingConfig, sample_tokens, token_logprobs
from jaxrl_lp.rollout.spec_config import SpecConfig
from jaxrl_lp.rollout.speculative import SpecStats, speculative_generate
from jaxrl_lp.rollout.step import LoopSpec, decode_step, prefill

__all__ = [
    "LoopSpec",
    "Request",
    "Rollout",
    "SamplingConfig",
    "SpecConfig",
    "SpecStats",
    "bucket_length",
    "check_request",
    "decode_step",
    "generate",
    "pad_prompts",
    "prefill",
    "sample_tokens",
    "speculative_generate",
    "token_logprobs",
]
