"""The exact replay (`rollout.replay`): the sampler's own executable, rows in their places.

What a run relies on, checked on CPU in the default suite: one compiled program
samples and replays (no compilation for the replay), the recorded exit steps
are taken under other weights, rows of several sampler calls replay each in its
call, a hand-built rollout replays as one call, a traced caller gets one clear
error, the hybrid step's value is computed by that program for any minibatch,
and the start probe stops a run with one line before it writes anything. The
slices of every model kind and policy are in tests/test_logprobs.py; the GPU
cells in tests/test_gpu.py. A speculative rollout's replay by its sampler's program runs in
the slow tier (tests/test_speculative.py replays speculative rollouts in the default suite).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_lp.bench.exactness import EOS_ID, TEMPERATURE, exactness_model, exactness_rollout
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rl.logprobs import traced_replay_logprobs
from jaxrl_lp.rollout.generate import Rollout, concat_rollouts, sampler_program, take_rows
from jaxrl_lp.rollout.replay import replay_logprobs
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.rollout.speculative import (
    replay_speculative,
    speculative_generate,
    speculative_program,
)
from jaxrl_lp.train.behaviour import bit_mismatch

PROMPTS = ((1, 5, 7), (2, 9, 4, 11, 3, 8), (6,), (12, 13))
FP32 = Policy.parse("fp32")


def _case(kind, seed=1, prompts=PROMPTS):
    cfg, params, loop = exactness_model(kind, loop_steps=3)
    ro = exactness_rollout(params, cfg, FP32, loop, prompts=prompts, num_samples=2,
                           max_new_tokens=8, seed=seed)
    return cfg, params, loop, ro


def _bits_equal(got, ro: Rollout):
    mask = np.asarray(ro.completion_mask) > 0
    np.testing.assert_array_equal(np.asarray(got)[mask], np.asarray(ro.logprobs)[mask])


def test_one_executable_samples_and_replays():
    """A replay of the whole batch or of any rows compiles nothing: it is the sampler's
    program, called with the recorded tokens forced."""
    cfg, params, _, ro = _case("looped_deferred")
    compiled = sampler_program._cache_size()
    _bits_equal(replay_logprobs(params, cfg, FP32, ro), ro)
    rows = np.array([6, 1, 3])
    _bits_equal(replay_logprobs(params, cfg, FP32, take_rows(ro, rows)), take_rows(ro, rows))
    assert sampler_program._cache_size() == compiled


def test_the_recorded_exits_are_taken_under_other_weights():
    """Under weights whose exit rule decides otherwise, the replay still runs the recorded
    schedule: it agrees with the traced replay of that schedule (1e-5), where a replay by the
    rule would not."""
    cfg, params, _, ro = _case("looped_deferred")
    other = dict(params, exit_gate={"kernel": -params["exit_gate"]["kernel"],
                                    "bias": params["exit_gate"]["bias"]})
    mask = np.asarray(ro.completion_mask) > 0
    exact = np.asarray(replay_logprobs(other, cfg, FP32, ro))
    traced = np.asarray(jax.jit(traced_replay_logprobs, static_argnums=(1, 2))(other, cfg, FP32,
                                                                               ro))
    np.testing.assert_allclose(exact[mask], traced[mask], atol=1e-5)
    # The other weights' rule exits elsewhere: a fresh sample's exit steps differ.
    fresh = exactness_rollout(other, cfg, FP32, ro.loop, prompts=PROMPTS, num_samples=2,
                              max_new_tokens=8, seed=1)
    assert (np.asarray(fresh.exit_steps)[:, 0] != np.asarray(ro.exit_steps)[:, 0]).any()


def test_rows_of_several_calls_replay_each_in_its_call():
    """A refilled batch: rows kept from one call (wider prompts) and a whole second call."""
    cfg, params, loop, ro = _case("dense")
    second = exactness_rollout(params, cfg, FP32, loop, prompts=((3, 4),), num_samples=2,
                               max_new_tokens=8, seed=5)
    both = concat_rollouts([take_rows(ro, np.array([7, 2])), second], pad_id=0)
    assert len(both.calls) == 2 and both.prompt_tokens.shape[1] == ro.prompt_tokens.shape[1]
    _bits_equal(replay_logprobs(params, cfg, FP32, both), both)


def _speculative_case(params, cfg, loop, prompts=PROMPTS, seed=1):
    """Self-speculation (1 of 3 loop steps drafts, k = 2), sampled, rows ending at EOS."""
    return speculative_generate(params, cfg, prompts, "self:loops=1,k=2", policy=FP32,
                                sampling=SamplingConfig(temperature=TEMPERATURE), loop=loop,
                                max_new_tokens=8, num_samples=2, eos_id=EOS_ID,
                                key=jax.random.PRNGKey(seed))


@pytest.mark.slow
def test_a_speculative_rollout_replays_by_its_samplers_program():
    """The speculative sampler's program replays with the recorded tokens, verification counts
    and exit steps forced in place of the drafts: nothing compiles, and the whole batch, 2-
    and 4-row slices, shuffled rows and a refill of two calls are the sampler's bits. The
    negative control: the former construction (`replay_speculative`, the chunks traced into a
    program at the slice's shape) is not, on the 2-row slices. Under weights whose rule exits
    elsewhere the recorded exits are taken: the traced replay of the chunks (which always
    takes them) agrees to 1e-5."""
    cfg, params, loop = exactness_model("looped_dense", loop_steps=3)
    ro = _speculative_case(params, cfg, loop)
    counts = np.asarray(ro.verify_counts)
    assert (counts > 1).any() and (counts[:, 0] != counts[0, 0]).any()  # ragged acceptance
    compiled = speculative_program._cache_size()
    _bits_equal(replay_logprobs(params, cfg, FP32, ro), ro)
    pairs = [take_rows(ro, np.arange(i, i + 2)) for i in range(0, 8, 2)]
    for size in (2, 4):
        for i in range(0, 8, size):
            part = take_rows(ro, np.arange(i, i + size))
            _bits_equal(replay_logprobs(params, cfg, FP32, part), part)
    rows = take_rows(ro, np.array([6, 1, 3]))
    _bits_equal(replay_logprobs(params, cfg, FP32, rows), rows)
    other = dict(params, exit_gate={"kernel": -params["exit_gate"]["kernel"],
                                    "bias": params["exit_gate"]["bias"]})
    exact = np.asarray(replay_logprobs(other, cfg, FP32, ro))
    assert speculative_program._cache_size() == compiled
    replay_traced = jax.jit(replay_speculative, static_argnums=(1, 2, 4))
    # The control, as `benchmarks/speculative_replay.py`'s `/traced`: re-traced at the 2-row
    # shape the chunks round otherwise on XLA:CPU (14 of the 64 tokens with JAX 0.10.2, 1 to 6
    # a slice); the sampler's program above differs on none.
    differ = [bit_mismatch(replay_traced(params, cfg, FP32, part, loop), part.logprobs,
                           part.completion_mask)[0] for part in pairs]
    assert sum(differ) > 0, differ
    traced = np.asarray(replay_traced(other, cfg, FP32, ro, loop))
    mask = np.asarray(ro.completion_mask) > 0
    np.testing.assert_allclose(exact[mask], traced[mask], atol=1e-5)
    fresh = _speculative_case(other, cfg, loop)  # the other weights' rule exits elsewhere
    assert (np.asarray(fresh.exit_steps)[mask] != np.asarray(ro.exit_steps)[mask]).any()
    second = _speculative_case(params, cfg, loop, prompts=((3, 4),), seed=5)
    both = concat_rollouts([take_rows(ro, np.array([7, 2])), second], pad_id=0)
    assert len(both.calls) == 2
    _bits_equal(replay_logprobs(params, cfg, FP32, both), both)


def test_a_hand_built_rollout_replays_as_one_call():
    """A rollout without recorded calls (built by hand) is one call of its own shape."""
    cfg, params, _, ro = _case("dense")
    bare = Rollout(prompt_tokens=ro.prompt_tokens, prompt_lengths=ro.prompt_lengths,
                   completion_tokens=ro.completion_tokens, completion_mask=ro.completion_mask,
                   logprobs=ro.logprobs, exit_steps=ro.exit_steps, loop_evals=ro.loop_evals,
                   weights_version=ro.weights_version, policy=ro.policy, loop=ro.loop,
                   temperature=ro.temperature)
    got = np.asarray(replay_logprobs(params, cfg, FP32, bare))
    mask = np.asarray(ro.completion_mask) > 0
    np.testing.assert_allclose(got[mask], np.asarray(ro.logprobs)[mask], atol=1e-5)


def test_a_traced_caller_gets_one_clear_error():
    cfg, params, _, ro = _case("dense")
    with pytest.raises(ValueError, match="cannot be traced.*traced_replay_logprobs"):
        jax.jit(lambda p: replay_logprobs(p, cfg, FP32, ro))(params)


@pytest.mark.parametrize("kind", [pytest.param("dense", marks=pytest.mark.slow),
                                  "looped_deferred"])  # 52 and 45 s cold on 2 cores
def test_the_hybrid_step_takes_each_minibatchs_value_from_the_samplers_program(kind):
    """At the sampler's weights the hybrid step's value is the sampler's log-probs bit for bit
    on every 2-row minibatch, and its ratio 1 (before, the value was traced into the step at the
    minibatch's shape, and rounded otherwise on XLA:CPU)."""
    from helpers import assert_hybrid_minibatches_are_the_samplers_bits

    cfg, params, loop, ro = _case(kind)
    assert_hybrid_minibatches_are_the_samplers_bits(cfg, params, loop, ro, FP32)


def test_the_start_probe_stops_a_planted_mismatch_with_one_line(tmp_path, monkeypatch, capsys):
    """A replay one ulp off the sampler: `jaxrl-lp train` exits 2 with one line naming the
    probe and the settings that run anyway, and nothing is written."""
    from helpers import TINY_MODEL, sets

    import jaxrl_lp.train.probe as probe
    from jaxrl_lp.cli.main import main

    real = probe.replay_logprobs
    monkeypatch.setattr(probe, "replay_logprobs",
                        lambda *a, **k: jnp.nextafter(real(*a, **k), 0.0))
    out = tmp_path / "run"
    assert main(["train", *sets(*TINY_MODEL, "grpo.prompts_per_step=4", "grpo.group_size=2",
                                f"run.out_dir={out}")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "grpo.start_probe" in err and "grpo.replay=always" in err and "nothing was written" \
        in err, err
    assert not out.exists()
