"""Off-policy GRPO (`grpo.max_staleness`): the schedule, exact ratios, placement and resume.

The exactness claim: with `max_staleness = 1` every update's hybrid value is
the replay under the weights the update computes with, bit for bit, and its
ratio's denominator the sampler's recorded log-probs, sampled on the previous
step's export; the replay of the rollout under the weights it was sampled on
is the sampler's bits (the numerics mismatch is exactly 0).
"""

import json

import jax
import numpy as np
import pytest
from helpers import FAIR_CAST, FINISHED, GRPO_MOVES

from jaxrl_lp.numerics.fingerprint import fingerprint_equal, tree_fingerprint
from jaxrl_lp.rl.logprob_programs import jit_learner_logprobs
from jaxrl_lp.train import apply_overrides, default_config, run_train
from jaxrl_lp.train.logger import without_wall_clock
from jaxrl_lp.train.rollout_queue import Held, RolloutQueue, weights_key

# Fair Cast with a KL term: the served copy moves at every GRPO step (tests/helpers.py),
# so a rollout one version behind is sampled on other weights than the update's.
MOVING = [*FINISHED, *FAIR_CAST, *GRPO_MOVES, "grpo.verify_every=1"]
SFT_STEPS = 2


def _records(run_dir):
    return [without_wall_clock(json.loads(line))
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _grpo(run_dir):
    return [r for r in _records(run_dir) if r["phase"] == "grpo"]


# --- the schedule --------------------------------------------------------------------------

class _Fake:
    """A queue's dispatch and prompt stream that record what they were asked."""

    def __init__(self):
        self.calls, self.drawn = [], 0

    def dispatch(self, step, version, weights, problems):
        self.calls.append((step, version, weights, problems))
        return f"ro{step}", {}

    def draw(self):
        self.drawn += 1
        return [self.drawn]


def test_queue_samples_step_n_on_the_export_of_step_n_minus_k():
    fake = _Fake()
    q = RolloutQueue(2, fake.dispatch, fake.draw, end=16)
    w = {v: Held((f"w{v}",)) for v in range(10, 16)}
    q.fill(10, w[10])  # the first GRPO step: 10, 11 and 12 on its export
    assert [(s, v) for s, v, _, _ in fake.calls] == [(10, 10), (11, 10), (12, 10)]
    entry, held = q.pop(10)
    assert (entry.step, entry.version, entry.problems, held) == (10, 10, (1,), w[10])
    q.fill(11, w[11])
    assert fake.calls[-1][:2] == (13, 11)
    entry, held = q.pop(11)
    assert (entry.version, held) == (10, w[10])
    assert q.meta() == [{"step": 12, "version": 10, "problems": [3]},
                        {"step": 13, "version": 11, "problems": [4]}]
    assert q.tree() == {weights_key(10): "w10", weights_key(11): "w11"}  # one copy each
    q.fill(12, w[12])
    entry, _ = q.pop(12)  # v10 is no longer needed by anything pending: released
    assert entry.version == 10 and set(q.held) == {11, 12}
    q.fill(13, w[13])
    q.fill(14, w[14])  # 15 and 16 exceed the run (end=16): only 15 is dispatched
    assert [s for s, *_ in fake.calls][-2:] == [14, 15]
    with pytest.raises(RuntimeError, match="no rollout dispatched for step 20"):
        q.pop(20)


def test_queue_restore_dispatches_the_same_rollouts_on_the_saved_weights():
    fake = _Fake()
    q = RolloutQueue(1, fake.dispatch, fake.draw)
    q.fill(5, Held(("w5",)))
    q.pop(5)
    meta, tree = q.meta(), q.tree()
    again = _Fake()
    r = RolloutQueue(1, again.dispatch, again.draw)
    r.restore(meta, tree, hold=lambda t: Held((t, t)))
    assert again.calls == [(6, 5, Held(("w5", "w5")), (2,))] and again.drawn == 0
    with pytest.raises(ValueError, match="staleness must be >= 1"):
        RolloutQueue(0, fake.dispatch, fake.draw)


# --- exact ratios --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def offpolicy_run(tmp_path_factory):
    """MOVING at max_staleness=1, uninterrupted, with every GRPO update's inputs captured:
    (the served copy the loss computes with, the rollout, the behaviour log-probs, the
    hybrid value given to the step), copied to the host before the step donates them."""
    import jaxrl_lp.train.program as program

    run = tmp_path_factory.mktemp("offpolicy") / "run"
    make, captured = program.make_grpo_step, []

    def capturing(*args, **kwargs):
        step = make(*args, **kwargs)

        def call(params, opt, ro, adv, old, ref, served, value, products):
            assert products is None  # an off-policy run records none (`grpo.reuse_products`)
            captured.append(jax.tree.map(np.asarray, (served, ro, old, value)))
            return step(params, opt, ro, adv, old, ref, served, value, products)

        return call

    program.make_grpo_step = capturing
    try:
        summary = run_train(apply_overrides(default_config(), [
            *MOVING, "grpo.max_staleness=1", f"run.out_dir={run}"]))
    finally:
        program.make_grpo_step = make
    return run, summary, captured


def test_every_ratio_is_the_replay_under_the_current_weights_over_the_behaviour(offpolicy_run):
    """Update n's value is the replay of its rollout under the served copy it computes with
    (recomputed here, bit for bit); its denominator the rollout's recorded log-probs, sampled
    on update n - 1's served copy, whose replay gives them back exactly."""
    from jaxrl_lp.numerics.policy import Policy
    from jaxrl_lp.train.validate import validate

    run, summary, captured = offpolicy_run
    cfg = apply_overrides(default_config(), [*MOVING, "grpo.max_staleness=1",
                                             f"run.out_dir={run}"])
    plan = validate(cfg)
    replay = jit_learner_logprobs(plan.model, Policy.parse("fp32"), "hybrid", loop=plan.loop)
    assert len(captured) == 6
    moved = 0
    for n, (served, ro, old, value) in enumerate(captured):
        assert int(ro.weights_version) == SFT_STEPS + max(n - 1, 0)
        own = captured[max(n - 1, 0)][0]  # the served copy the rollout was sampled on
        assert fingerprint_equal(ro.weights_digest, tree_fingerprint(own))
        mask = np.asarray(ro.completion_mask) > 0
        bits = lambda x, m=mask: np.asarray(x, np.float32).view(np.uint32)[m]
        # The numerics alone: the replay on the rollout's own weights is the sampler's bits.
        np.testing.assert_array_equal(bits(replay(own, ro)), bits(ro.logprobs))
        # The value: the replay under the update's weights, bit for bit, and the behaviour
        # log-probs the step anchors on (the default anchor) are that same replay.
        now = replay(served, ro)
        np.testing.assert_array_equal(bits(value), bits(now))
        np.testing.assert_array_equal(bits(old), bits(now))
        if n:
            moved += int((bits(value) != bits(ro.logprobs)).any())
        else:  # the first GRPO step learns from its own export's rollout: the recorded bits
            np.testing.assert_array_equal(bits(value), bits(ro.logprobs))
    assert moved == 5, "the policy moved between versions at every later step"
    grpo = _grpo(run)
    assert [r["rollout_staleness"] for r in grpo] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert all(r["mismatch_max_abs_dlogp"] == 0.0 and r["mismatch_k1"] == 0.0 for r in grpo)
    assert all(r["replay_verified"] == 1.0 for r in grpo)
    assert all(r["offpolicy_max_abs_dlogp"] > 0 for r in grpo[1:])
    assert all(r["replayed_updates"] == 0.0 for r in grpo)  # the behaviour replay is the value
    # The step's ratio, from its inputs: mean over the tokens of exp(value - recorded).
    for (_, ro, _, value), r in zip(captured, grpo, strict=True):
        mask = np.asarray(ro.completion_mask) > 0
        ratio = np.exp(np.asarray(value, np.float64) - np.asarray(ro.logprobs, np.float64))
        np.testing.assert_allclose(r["ratio_mean"], ratio[mask].mean(), rtol=1e-6)


def test_staleness_zero_is_the_synchronous_loop(offpolicy_run, finished_runs):
    """`max_staleness=0` is today's loop: the shared Fair Cast run (no key set) and the
    same run's GRPO records name no staleness but 0; the off-policy run differs after its
    first GRPO step (its rollouts are a version behind)."""
    fair, _ = finished_runs["fair"]
    sync = _grpo(fair)
    assert [r["rollout_staleness"] for r in sync] == [0.0] * 6
    assert not any(k.startswith("offpolicy_") for r in sync for k in r)
    off = _grpo(offpolicy_run[0])
    assert off[0] == sync[0]  # step 1: both learn from the first export's rollout
    assert off[1]["loss"] != sync[1]["loss"]


def test_a_resume_inside_grpo_needs_the_same_staleness(tmp_path):
    run = tmp_path / "run"
    run_train(apply_overrides(default_config(), [*MOVING, "grpo.max_staleness=1",
                                                 f"run.out_dir={run}"]), stop_after=4)
    with pytest.raises(ValueError, match="grpo.max_staleness=1; resuming it with "
                                         "grpo.max_staleness=0"):
        run_train(apply_overrides(default_config(), [*MOVING, f"run.out_dir={run}"]))


@pytest.mark.slow
def test_sigkill_during_an_overlapped_step_resumes_bit_identically(tmp_path, offpolicy_run):
    """The sampler on a device of its own (device 1) samples step n + 1 while the learner
    (device 0) updates on step n; the run is SIGKILLed before its 4th GRPO update, with the
    next rollout in flight and the newest checkpoint two steps back. Resumed, its kept
    checkpoints (the sampler's pending weights included) and its records equal the
    uninterrupted run's, which ran sampler and learner in turn on one device: the numbers
    depend on the step numbers, not on the overlap."""
    from helpers import checkpoints
    from test_train import _assert_resumed_exactly, _kill_and_resume

    ref_dir = offpolicy_run[0]
    cut = tmp_path / "cut"
    _kill_and_resume(cut, [*MOVING, "grpo.max_staleness=1", "run.learner_mesh=data=1",
                           "run.sampler_mesh=data=1"], "before_update", 4)
    _assert_resumed_exactly(cut, ref_dir)
    meta = {s: c["meta"] for s, c in checkpoints(cut).items()}
    # After step 6 the rollout of step 6 (0-based) is in flight, sampled on step 5's export;
    # after the last step nothing is.
    assert [(p["step"], p["version"]) for p in meta[6]["pending"]] == [(6, 5)]
    assert meta[8]["pending"] == [] and meta[6]["max_staleness"] == 1


@pytest.mark.slow
@pytest.mark.ci
def test_study_staleness_quick(tmp_path, capsys):
    from jaxrl_lp.cli.main import main

    out = tmp_path / "study"
    assert main(["study", "staleness", "--quick", "--arms", "k0,k1_decoupled", "--steps", "3",
                 "--out", str(out)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == json.loads((out / "staleness.json").read_text())
    k0, k1 = got["arms"]["k0"], got["arms"]["k1_decoupled"]
    assert k0["rollout_staleness_max"] == 0.0 and k1["rollout_staleness_max"] == 1.0
    assert k0["offpolicy_k3_mean"] is None and k1["offpolicy_k3_mean"] is not None
    # Verified every step, matched policies: the numerics part is exactly 0 in both arms.
    assert k0["mismatch_max_abs_dlogp"] == 0.0 == k1["mismatch_max_abs_dlogp"]
    assert k0["mismatch_measured_steps"] == 3 == k1["mismatch_measured_steps"]
    assert k0["gain_vs_synchronous"] == 0.0
    for name in ("accuracy.png", "reward.png", "offpolicy.png", "staleness_series.json"):
        assert (out / name).is_file(), name
    assert main(["study", "staleness", "--arms", "k9"]) == 2
