"""XLA rounds where the program rounds: bf16 replay == sampler on a 64-row batch.

With XLA's default `xla_allow_excess_precision=true` a fusion may skip a
bf16 round trip, differently in the sampler's and the learner's programs; on
CPU this replay differed from the sampler by 5.7e-3 in log-prob at 64 rows
(16 rows happened to agree). `import jaxrl_lp` sets the flag to false.
"""

import os

import jax
import numpy as np

import jaxrl_lp
from jaxrl_lp.bench.exactness import exactness_model, exactness_rollout, masked_max_abs_diff
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rl.logprobs import learner_logprobs


def test_the_package_sets_the_rounding_flag():
    assert jaxrl_lp.ROUNDING_FLAG in os.environ["XLA_FLAGS"]


def test_bf16_replay_of_64_rows_is_bit_equal_to_the_sampler():
    cfg, params, loop = exactness_model("dense", loop_steps=4)
    policy = Policy.parse("bf16")
    rng = np.random.RandomState(0)
    prompts = tuple(tuple(int(t) for t in rng.randint(3, cfg.vocab_size, rng.randint(2, 8)))
                    for _ in range(8))
    ro = exactness_rollout(params, cfg, policy, loop, prompts=prompts, num_samples=8,
                           max_new_tokens=8)
    assert ro.completion_mask.shape[0] == 64
    replay = jax.jit(lambda p: learner_logprobs(p, cfg, policy, ro, "replay", loop=loop)[0])(params)
    assert masked_max_abs_diff(replay, ro.logprobs, ro.completion_mask) == 0.0
