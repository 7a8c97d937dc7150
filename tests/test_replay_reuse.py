"""The learner takes the sampler's recorded log-probs where they are its replay (`grpo.replay`).

- The weights fingerprint sees any one bit and not the sharding; rollouts record it.
- A GRPO step given the recorded log-probs as the hybrid's value updates the
  parameters to exactly the bits of the step that replays, on the dense
  (packed), looped-deferred, speculative, low-bit (coded) and sharded paths,
  and its program has no replay in it.
- The training program: at `grpo.minibatches=4` exactly the three later
  minibatches replay, with the same ratios, metrics and parameters as
  `grpo.replay=always`; the `mismatch_*` metrics appear only where measured;
  a verification that finds the replay off the sampler's bits stops the run.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import LEARNS, short_run

from jaxrl_lp.bench.exactness import EXIT_RULE, exactness_model, exactness_rollout
from jaxrl_lp.numerics.fingerprint import fingerprint_equal, tree_fingerprint
from jaxrl_lp.numerics.policy import FP32, Policy
from jaxrl_lp.rl import LossConfig, make_grpo_step
from jaxrl_lp.rollout import LoopSpec
from jaxrl_lp.rollout.generate import split_rows, take_rows
from jaxrl_lp.train import apply_overrides, default_config, run_train
from jaxrl_lp.train.behaviour import ReplayMismatchError, ReplayRule, check_replay_equal
from jaxrl_lp.train.logger import without_wall_clock

PROMPTS = ((1, 5, 7), (2, 9, 4, 11, 3, 8), (6,), (3, 3))
G, N = 2, 8
copy = lambda t: jax.tree.map(jnp.copy, t)


# ---------------------------------------------------------------- the fingerprint
def test_fingerprint_sees_any_one_bit_and_not_the_sharding():
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxrl_lp.parallel import make_mesh

    rng = np.random.RandomState(0)
    tree = {"w": jnp.asarray(rng.randn(16, 8), jnp.float32),
            "b": jnp.asarray(rng.randn(8), jnp.bfloat16),
            "codes": jnp.asarray(rng.randint(-1, 2, (8, 4)), jnp.int8),
            "mask": jnp.asarray(rng.rand(8) > 0.5)}
    fp = tree_fingerprint(tree)
    assert fp.dtype == jnp.uint32 and fp.shape == (2,)
    for name, leaf in tree.items():
        bits = np.asarray(jax.lax.bitcast_convert_type(leaf, jnp.uint8) if leaf.dtype != bool
                          else leaf.astype(jnp.uint8)).reshape(-1).copy()
        for i in rng.choice(bits.size, 3, replace=False):
            flipped = bits.copy()
            flipped[i] ^= 1 << rng.randint(0, 8 if leaf.dtype != bool else 1)
            if leaf.dtype == bool:
                new = jnp.asarray(flipped.reshape(leaf.shape).astype(bool))
            else:
                new = jax.lax.bitcast_convert_type(
                    jnp.asarray(flipped).reshape(*leaf.shape, leaf.dtype.itemsize)
                    if leaf.dtype.itemsize > 1 else jnp.asarray(flipped).reshape(leaf.shape),
                    leaf.dtype)
            assert not fingerprint_equal(tree_fingerprint({**tree, name: new}), fp), (name, i)
    # -0.0 and 0.0 are different bits: a copy that rounds differently is another copy.
    zeros = {"z": jnp.zeros(4)}
    assert not fingerprint_equal(tree_fingerprint({"z": -zeros["z"]}), tree_fingerprint(zeros))
    # The same values laid over 8 devices (integer sums do not depend on the order).
    mesh = make_mesh("fsdp=8")
    sharded = {**tree, "w": jax.device_put(tree["w"], NamedSharding(mesh, PartitionSpec("fsdp")))}
    assert len(sharded["w"].sharding.device_set) == 8
    assert fingerprint_equal(tree_fingerprint(sharded), fp)
    assert not fingerprint_equal(None, fp)


@functools.cache
def _model(kind):
    return exactness_model(kind, loop_steps=2)


@functools.cache
def _rollout(kind, pol="fp32"):
    cfg, params, loop = _model(kind)
    return exactness_rollout(params, cfg, Policy.parse(pol), loop, prompts=PROMPTS,
                             num_samples=G, max_new_tokens=N)


def test_rollouts_record_the_weights_they_ran_and_the_rule_reads_it():
    cfg, params, _ = _model("looped_dense")
    ro = _rollout("looped_dense")
    assert fingerprint_equal(ro.weights_digest, tree_fingerprint(params))
    rule = ReplayRule("auto", "hybrid", matched=True)
    assert rule.recorded(ro, params)
    moved = {**params, "final_norm": params["final_norm"] + 1e-3}
    assert not rule.recorded(ro, moved)
    for off in (ReplayRule("always", "hybrid", True), ReplayRule("auto", "dense", True),
                ReplayRule("auto", "hybrid", False)):
        assert not off.recorded(ro, params), off
    import dataclasses

    assert not rule.recorded(dataclasses.replace(ro, weights_digest=None), params)
    # Minibatches and micro-batches keep it (the scan over micro-batches splits it too).
    assert fingerprint_equal(take_rows(ro, np.arange(2)).weights_digest, ro.weights_digest)
    assert split_rows(ro, 2).weights_digest.shape == (2, 2)


def test_check_replay_equal_compares_bits_on_the_mask():
    ro = _rollout("looped_dense")
    check_replay_equal(ro.logprobs + 0.0, ro, step=3)  # the same bits
    off_mask = jnp.where(ro.completion_mask > 0, ro.logprobs, 7.0)
    check_replay_equal(off_mask, ro, step=3)  # padding is not compared
    one_ulp = ro.logprobs.at[0, 0].set(jnp.nextafter(ro.logprobs[0, 0], 0.0))
    with pytest.raises(ReplayMismatchError, match=r"at step 3 .* on 1 of \d+ tokens .*"
                                                  r"grpo.replay=always"):
        check_replay_equal(one_ulp, ro, step=3)


# ---------------------------------------------------------------- the step on recorded values
def _two_steps(cfg, params, ro, loop, *, policy=FP32, opt=None, **kw):
    """(params, metrics) of one update with the replay and one with the recorded values."""
    opt = opt or optax.adam(1e-2)
    step = make_grpo_step(cfg, Policy.parse(policy), LossConfig(), opt, loop=loop, **kw)
    adv = jnp.asarray(np.linspace(-1.0, 1.0, ro.logprobs.shape[0]), jnp.float32)
    out = []
    for recorded in (None, ro.logprobs):
        p, _, m = step(copy(params), opt.init(params), ro, adv, ro.logprobs, None, None, recorded)
        out.append((p, {k: float(v) for k, v in m.items()}))
    return step, adv, out


def _assert_same_update(out, params):
    (p_replay, m_replay), (p_recorded, m_recorded) = out
    assert m_recorded == m_replay
    moved = 0.0
    for a, b, p0 in zip(jax.tree.leaves(p_recorded), jax.tree.leaves(p_replay),
                        jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        moved = max(moved, float(np.max(np.abs(np.asarray(a, np.float32)
                                                - np.asarray(p0, np.float32)))))
    assert moved > 0.0  # a real update


def _while_loops(lowered) -> int:
    return lowered.as_text().count("stablehlo.while")


# The looped deferred step here; the dense packed bf16 one, the speculative and the coded
# steps in the slow tier (`-m slow`; each compiles two steps: about 25 CPU-s), and the
# sharded one there too.
@pytest.mark.parametrize("kind,pol", [("looped_deferred", "fp32"),
                                      pytest.param("dense", "bf16", marks=pytest.mark.slow)])
def test_a_step_on_the_recorded_logprobs_is_the_replaying_step_bit_for_bit(kind, pol):
    cfg, params, loop = _model(kind)
    ro = _rollout(kind, pol)
    step, adv, out = _two_steps(cfg, params, ro, loop, policy=pol)
    _assert_same_update(out, params)
    assert out[1][1]["ratio_mean"] == 1.0  # the first update's ratio, exactly
    # The replay is not in the recorded program: fewer loops (the replay is a scan or a
    # while_loop over the completion).
    opt = optax.adam(1e-2)
    lower = lambda rec: step.lower(copy(params), opt.init(params), ro, adv, ro.logprobs, None,
                                   None, rec)
    assert _while_loops(lower(ro.logprobs)) < _while_loops(lower(None))


@pytest.mark.slow
def test_speculative_rollouts_on_recorded_logprobs():
    from jaxrl_lp.rollout.sampling import SamplingConfig
    from jaxrl_lp.rollout.speculative import speculative_generate

    cfg, params, _ = _model("looped_dense")
    loop = LoopSpec(EXIT_RULE, "dense")
    ro = speculative_generate(params, cfg, PROMPTS, "self:loops=1,k=2", policy=Policy.parse("fp32"),
                              sampling=SamplingConfig(temperature=0.8), max_new_tokens=N,
                              num_samples=G, loop=loop, key=jax.random.PRNGKey(2))
    assert ro.verify_tokens == 3
    assert fingerprint_equal(ro.weights_digest, tree_fingerprint(params))
    _, _, out = _two_steps(cfg, params, ro, loop)
    _assert_same_update(out, params)


@pytest.mark.slow
def test_coded_weights_on_recorded_logprobs():
    """`sft.optimizer=error_diffusion`: the train tree's materialized weights sampled."""
    from jaxrl_lp.optim.weights import CodedWeights
    from jaxrl_lp.rollout.generate import generate
    from jaxrl_lp.rollout.sampling import SamplingConfig

    cfg, params, loop = _model("looped_dense")
    weights = CodedWeights("binary")
    train = weights.from_params(params)
    served = jax.jit(weights.materialize)(train)
    ro = generate(served, cfg, PROMPTS, policy=Policy.parse("fp32"), sampling=SamplingConfig(temperature=0.8),
                  max_new_tokens=N, num_samples=G, eos_id=2, loop=loop,
                  key=jax.random.PRNGKey(4))
    # What the training program compares: the materialized train tree, as the sampler got it.
    assert ReplayRule("auto", "hybrid", True).recorded(ro, jax.jit(weights.materialize)(train))
    from jaxrl_lp.optim import OptimizerSpec

    opt = OptimizerSpec.parse("error_diffusion:binary:k=4", "sft.optimizer").transform(
        optax.adam(1e-2))
    _, _, out = _two_steps(cfg, train, ro, loop, weights=weights, opt=opt)
    _assert_same_update(out, train)


@pytest.mark.slow
def test_sharded_step_on_recorded_logprobs():
    from jaxrl_lp.parallel import make_mesh, param_shardings
    from jaxrl_lp.parallel.shard import put_tree
    from jaxrl_lp.rollout.generate import generate
    from jaxrl_lp.rollout.sampling import SamplingConfig

    cfg, params, loop = _model("looped_deferred")
    mesh = make_mesh("fsdp=8")
    sharded = put_tree(params, param_shardings(params, cfg, mesh))
    # Sampled on the mesh, as the training program samples on its mesh.
    ro = generate(sharded, cfg, PROMPTS, policy=FP32, sampling=SamplingConfig(temperature=0.8),
                  max_new_tokens=N, num_samples=G, eos_id=2, loop=loop,
                  key=jax.random.PRNGKey(4), mesh=mesh)
    # The fingerprint of the sharded weights is the one-device weights'.
    assert fingerprint_equal(ro.weights_digest, tree_fingerprint(params))
    _, _, out = _two_steps(cfg, sharded, ro, loop, mesh=mesh)
    _assert_same_update(out, params)


# ---------------------------------------------------------------- the training program
def _cfg(out, *extra):
    return apply_overrides(default_config(), [
        *short_run(sft_steps=2, grpo_steps=3, checkpoint_every=50), "grpo.verify_every=2",
        f"run.out_dir={out}", *extra])


def _records(run_dir):
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


REUSE_KEYS = ("replayed_updates", "behaviour_recomputed", "replay_verified")


@pytest.mark.slow
def test_a_step_on_the_behaviour_replay_is_the_replaying_step_bit_for_bit():
    """Where the weights moved since sampling (an off-policy rollout), the training program's
    behaviour log-probs are the replay under the update's weights, taken micro-batch by
    micro-batch (`jit_learner_logprobs`); given as the first update's hybrid value, the update
    is the one that replays inside the step, bit for bit, micro-batched the same way."""
    from jaxrl_lp.rl.logprob_programs import jit_learner_logprobs

    cfg, params, loop = _model("looped_dense")
    ro = _rollout("looped_dense")
    moved = jax.tree.map(lambda x: x * (1.0 + 1e-3), params)  # the learner moved on
    behaviour = jit_learner_logprobs(cfg, Policy.parse("fp32"), "hybrid", loop=loop,
                                     micro_batches=2)(moved, ro)
    mask = np.asarray(ro.completion_mask) > 0
    assert (np.asarray(behaviour)[mask] != np.asarray(ro.logprobs)[mask]).any()
    opt = optax.adam(1e-2)
    step = make_grpo_step(cfg, Policy.parse("fp32"), LossConfig(), opt, loop=loop,
                          micro_batches=2)
    adv = jnp.asarray(np.linspace(-1.0, 1.0, ro.logprobs.shape[0]), jnp.float32)
    out = []
    for value in (None, behaviour):
        p, _, m = step(copy(moved), opt.init(moved), ro, adv, behaviour, None, None, value)
        out.append((p, {k: float(v) for k, v in m.items()}))
    _assert_same_update(out, moved)
    assert out[1][1]["ratio_mean"] != 1.0  # the policy change, against the recorded values


@pytest.mark.slow
def test_minibatches_4_replay_exactly_the_three_later_ones(tmp_path):
    """`auto` replays the three later minibatches; `always` all four. On XLA:CPU a replay of a
    minibatch's rows rounds otherwise than the sampler's whole batch (about 1 ulp on a third
    of the tokens), so `always` was never exact on its first minibatch and the two runs
    agree to rounding, not bit for bit; `auto`'s first update takes the sampler's bits."""
    from jaxrl_lp.plan import iteration_updates
    from jaxrl_lp.train.checkpoint import Checkpointer

    runs, planned = {}, {}
    for mode in ("auto", "always"):
        out = tmp_path / mode
        cfg = _cfg(out, *LEARNS, "grpo.minibatches=4", f"grpo.replay={mode}")
        run_train(cfg)
        runs[mode] = [r for r in _records(out) if r["phase"] == "grpo"]
        planned[mode] = iteration_updates(cfg)
    auto, always = runs["auto"], runs["always"]
    # `jaxrl-lp plan` prices the updates by the same rule: one recorded, three replaying.
    assert planned["auto"] == {"recorded": 1, "replaying": 3, "dense": 0, "behaviour": 0.5}
    assert planned["always"] == {"recorded": 0, "replaying": 4, "dense": 0, "behaviour": 1.0}
    # From the second step Adam's moments move every update; at the first, the updates
    # before the first minibatch with a signal leave the weights as they were.
    assert [r["replayed_updates"] for r in auto[1:]] == [3.0, 3.0]
    assert 0.0 <= auto[0]["replayed_updates"] <= 3.0 and auto[0]["grad_norm"] > 0
    assert [r["replayed_updates"] for r in always] == [4.0, 4.0, 4.0]
    # GRPO steps 0 and 2 verify (verify_every=2): the whole batch replayed in one pass, as
    # the sampler ran it, and found bit-equal.
    assert [r["replay_verified"] for r in auto] == [1.0, 0.0, 1.0]
    assert [r["behaviour_recomputed"] for r in auto] == [1.0, 0.0, 1.0]
    assert auto[0]["mismatch_max_abs_dlogp"] == 0.0 and auto[2]["mismatch_k3"] == 0.0
    assert "mismatch_k3" not in auto[1]  # a mismatch nothing measured is not logged
    # `always` measures its behaviour log-probs in minibatch slices: within rounding.
    assert [r["behaviour_recomputed"] for r in always] == [1.0, 1.0, 1.0]
    assert all(r["replay_verified"] == 0.0 for r in always)
    assert all(r["mismatch_max_abs_dlogp"] < 1e-5 for r in always)
    # The same samples at the first step (sampled before any update), the same course after.
    for k in ("reward_mean", "accuracy", "response_length"):
        assert auto[0][k] == always[0][k], k
    for a, b in zip(auto, always, strict=True):
        np.testing.assert_allclose(a["ratio_mean"], b["ratio_mean"], rtol=1e-5)
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-3, atol=1e-6)
    params = {}
    for mode in runs:
        ckpt = Checkpointer(tmp_path / mode)
        params[mode] = ckpt.manager.restore(ckpt.latest_step())["state"]["params"]
        ckpt.close()
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 params["auto"], params["always"])
    for phase in ("export", "sample", "score", "behaviour", "update"):
        assert all(r[f"timing_s/{phase}"] >= 0.0 for r in auto), phase
    assert all(r["timing_s/iteration"] > 0 and r["update_tokens_per_s"] > 0 for r in auto)


@pytest.mark.slow
def test_replay_always_at_one_minibatch_is_the_auto_run_bit_for_bit(finished_runs, tmp_path):
    """At mu = 1 and one minibatch, `always` replays what `auto` takes from the rollout:
    the same bits, so the same run (the shared `plain` run is `auto`)."""
    import shutil

    from helpers import FINISHED

    from jaxrl_lp.train.checkpoint import Checkpointer

    plain = finished_runs["plain"][0]
    out = tmp_path / "always"
    run_train(apply_overrides(default_config(), [*FINISHED, f"run.out_dir={out}",
                                                 "grpo.replay=always"]))
    strip = lambda r: {k: v for k, v in without_wall_clock(r).items()
                       if k not in REUSE_KEYS and not k.startswith("mismatch_")}
    assert [strip(r) for r in _records(out)] == [strip(r) for r in _records(plain)]
    grpo = [r for r in _records(out) if r["phase"] == "grpo"]
    assert all(r["replayed_updates"] == 1.0 and r["mismatch_max_abs_dlogp"] == 0.0
               and r["ratio_mean"] == 1.0 for r in grpo)
    copy_dir = tmp_path / "plain"
    shutil.copytree(plain, copy_dir)
    restored = {}
    for name, d in (("auto", copy_dir), ("always", out)):
        ckpt = Checkpointer(d)
        restored[name] = ckpt.manager.restore(ckpt.latest_step())["state"]["params"]
        ckpt.close()
    jax.tree.map(np.testing.assert_array_equal, restored["auto"], restored["always"])


def test_a_finished_run_took_the_recorded_logprobs(finished_runs):
    """The shared runs (minibatches 1, verify_every 10): only the first GRPO step replays the
    behaviour log-probs, and no update replays, with or without the served copy's loss; the
    plan's rule (`plan.iteration_updates`) says so of their configs."""
    from jaxrl_lp.plan import iteration_updates
    from jaxrl_lp.train.run_io import run_config

    for name in ("plain", "fair"):
        counts = iteration_updates(run_config(finished_runs[name][0]))
        assert (counts["recorded"], counts["replaying"]) == (1, 0), name
        # Verified every 10 steps; under the served copy's loss the sync diagnostics take the
        # master's log-probs every step.
        assert counts["behaviour"] == (1.1 if name == "fair" else 0.1), name
        grpo = [r for r in _records(finished_runs[name][0]) if r["phase"] == "grpo"]
        assert len(grpo) == 6
        assert [r["behaviour_recomputed"] for r in grpo] == [1.0] + [0.0] * 5, name
        assert [r["replay_verified"] for r in grpo] == [1.0] + [0.0] * 5, name
        assert all(r["replayed_updates"] == 0.0 for r in grpo), name
        assert grpo[0]["mismatch_max_abs_dlogp"] == 0.0
        assert not any("mismatch_k1" in r for r in grpo[1:]), name


def test_a_verification_off_the_samplers_bits_stops_the_run(tmp_path, monkeypatch):
    import jaxrl_lp.train.program as program

    real = program.jit_learner_logprobs

    def one_ulp_off(*args, **kwargs):
        fn = real(*args, **kwargs)
        return lambda p, ro: jnp.nextafter(fn(p, ro), 0.0)

    monkeypatch.setattr(program, "jit_learner_logprobs", one_ulp_off)
    with pytest.raises(ReplayMismatchError, match="at step 2 .*on 32 of 32 tokens.*grpo.replay=always"):
        run_train(_cfg(tmp_path / "off", "grpo.verify_every=1"))
