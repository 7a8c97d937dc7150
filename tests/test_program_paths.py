"""The training program's GRPO paths: mu > 1, minibatches > 1, dynamic sampling with refill,
overlong shaping, each run for real and checked update by update.

One warm-start (one-digit sums, so that some groups' rewards vary) is trained once for the
module; each test copies it and runs a few GRPO steps from it. The GRPO step the program
builds is wrapped (`make_grpo_step`, patched in `train.program`) so that every optimizer
update is seen: whether it was handed the rollout's recorded log-probs or replayed, its
ratio, its advantages and its completion mask. The runs share their shapes (mu = 2, two
minibatches, 6 new tokens), so the second compiles little.
"""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY_MODEL

import jaxrl_lp.train.grpo_iteration as grpo_iteration
import jaxrl_lp.train.program as program
import jaxrl_lp.train.rollout_queue as rollout_queue
from jaxrl_lp.train import apply_overrides, default_config, run_train
from jaxrl_lp.train.behaviour import ReplayMismatchError
from jaxrl_lp.train.checkpoint import Checkpointer
from jaxrl_lp.train.logger import without_wall_clock

SFT, STEPS, P, G = 75, 4, 4, 4
MAX_NEW, BUFFER = 6, 4  # the penalty ramps over completions of 3..6 tokens (EOS included)
UPDATES = 4  # mu = 2 passes x 2 minibatches
BASE = [*TINY_MODEL, f"sft.steps={SFT}", "sft.batch_size=16", "sft.lr=1e-2",
        "task.max_digits=1", f"grpo.steps={STEPS}", f"grpo.prompts_per_step={P}",
        f"grpo.group_size={G}", f"grpo.max_new_tokens={MAX_NEW}", "grpo.mu=2",
        "grpo.minibatches=2", "run.eval_every=100", "run.eval_size=8",
        "run.checkpoint_every=1000", "run.progress=false"]
REFILLS = 8


def _dynamic(refills=REFILLS):
    return ["grpo.dynamic_sampling=true", f"grpo.max_refill_rounds={refills}",
            "grpo.verify_every=2"]


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    """The warm-start's run directory (a checkpoint at step SFT, no GRPO step yet)."""
    out = tmp_path_factory.mktemp("program_paths") / "warm"
    run_train(apply_overrides(default_config(), [*BASE, f"run.out_dir={out}"]), stop_after=SFT)
    return out


def _run(warm, out, extra, stop_after=None):
    """Runs GRPO from a copy of the warm-start (unless `out` exists: a resume); returns
    (metrics records of the GRPO steps, one dict per optimizer update, the rewards each
    step's advantages were computed from)."""
    if not out.exists():
        shutil.copytree(warm, out)
    updates, rewards = [], []
    real, real_adv = program.make_grpo_step, grpo_iteration.group_advantages

    def advantages(r, *args, **kwargs):
        rewards.append(np.asarray(r))
        return real_adv(r, *args, **kwargs)

    def make(*args, **kwargs):
        step = real(*args, **kwargs)

        def seen(params, opt, ro, adv, old, ref, served, replay, products):
            out = step(params, opt, ro, adv, old, ref, served, replay, products)
            updates.append({"replayed": replay is None, "adv": np.asarray(adv),
                            "mask": np.asarray(ro.completion_mask),
                            **{k: float(v) for k, v in out[2].items()}})
            return out
        return seen

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(program, "make_grpo_step", make)
        mp.setattr(grpo_iteration, "group_advantages", advantages)
        run_train(apply_overrides(default_config(), [*BASE, f"run.out_dir={out}", *extra]),
                  stop_after=stop_after)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["phase"] == "grpo"], updates, rewards


def _lengths(u):
    return u["mask"].sum(1)


@pytest.mark.slow
def test_mu_and_minibatches_replay_after_the_first_update_and_overlong_shaping(
        warm_start, tmp_path):
    grpo, updates, rewards = _run(warm_start, tmp_path / "run",
                                  [f"grpo.overlong_buffer={BUFFER}"])
    assert len(grpo) == STEPS and len(updates) == STEPS * UPDATES and len(rewards) == STEPS
    # The first GRPO step's first minibatch has an informative group: its update moves the
    # weights, so every later update of the step computes with weights the sampler never ran.
    assert np.abs(updates[0]["adv"]).max() > 0
    for s, rec in enumerate(grpo):
        mine = updates[s * UPDATES:(s + 1) * UPDATES]
        # Update 1 computes with the sampler's weights: it is handed the recorded log-probs,
        # and its ratio is exactly 1 (learner value == behaviour == sampler, bit for bit).
        assert not mine[0]["replayed"] and mine[0]["ratio_mean"] == 1.0
        # The later minibatch of pass 1 and both of pass 2 replay, and their ratio moved.
        assert [u["replayed"] for u in mine[1:]] == [True, True, True]
        for u in mine[1:]:
            assert u["ratio_mean"] != 1.0 and abs(u["ratio_mean"] - 1.0) < 0.1, u["ratio_mean"]
        assert rec["replayed_updates"] == 3.0
        assert rec["ratio_mean"] == pytest.approx(np.mean([u["ratio_mean"] for u in mine]),
                                                  rel=1e-6)
        # Overlong shaping: -(L - (MAX_NEW - BUFFER)) / BUFFER, clipped to [-1, 0], per
        # completion of L tokens, averaged over the batch (both minibatches of pass 1).
        lengths = np.concatenate([_lengths(u) for u in mine[:2]])
        want = -np.clip((lengths - (MAX_NEW - BUFFER)) / BUFFER, 0.0, 1.0)
        assert rec["overlong_penalty_mean"] == pytest.approx(float(want.mean()), abs=1e-7)
        assert rec["overlong_frac"] == pytest.approx(float((want < 0).mean()), abs=1e-7)
        # The advantages see the task's reward (0 or 1) plus the penalty; reward_mean is the
        # task's alone.
        task = rewards[s] - want.astype(np.float32)
        assert set(task.tolist()) <= {0.0, 1.0}
        assert rec["reward_mean"] == pytest.approx(float(task.mean()), abs=1e-7)
    # Completions past MAX_NEW - BUFFER tokens exist, so the penalty is not 0.
    assert min(r["overlong_penalty_mean"] for r in grpo) < 0.0
    assert min(r["overlong_frac"] for r in grpo) > 0.0


# Both bounds (REFILLS rounds, and 1: the bound hit) and the resume run in the slow tier (four
# runs between them); the refill's unit tests are tests/test_dynamic_sampling.py.
@pytest.mark.slow
@pytest.mark.parametrize("refills", [REFILLS, 1])
def test_dynamic_sampling_refills_the_batch_with_informative_groups(warm_start, tmp_path,
                                                                    refills):
    """At 8 refill rounds every batch here is filled; at 1 the bound is hit and masks."""
    grpo, updates, rewards = _run(warm_start, tmp_path / "run", _dynamic(refills))
    assert len(grpo) == STEPS and len(updates) == STEPS * UPDATES and len(rewards) == STEPS
    for s, rec in enumerate(grpo):
        rounds = rec["refill_rounds"]
        assert rounds == int(rounds) and 0 <= rounds <= refills
        assert rec["informative_groups"] + rec["masked_groups"] == P
        # Every drawn group is informative or zero-variance; the batch takes at most the
        # informative ones.
        assert rec["informative_groups"] <= P * (1 + rounds) - rec["zero_variance_groups"]
        assert rec["refilled_groups"] <= rec["informative_groups"]
        # Short of the bound the batch is full; groups are masked only where it was hit.
        if rounds < refills:
            assert rec["masked_groups"] == 0.0
        # The advantages' rewards: as many zero-variance groups as masked ones, no penalty.
        assert (rewards[s].reshape(P, G).std(1) == 0).sum() == rec["masked_groups"]
        assert rec["reward_mean"] == pytest.approx(float(rewards[s].mean()), abs=1e-7)
        # The batch the updates saw (pass 1: both minibatches): a group is informative where
        # its advantages are not all 0, and a masked group has no completion token left.
        adv = np.concatenate([u["adv"] for u in updates[s * UPDATES:s * UPDATES + 2]])
        mask = np.concatenate([u["mask"] for u in updates[s * UPDATES:s * UPDATES + 2]])
        live = np.abs(adv.reshape(P, G)).max(1) > 0
        assert live.sum() == rec["informative_groups"]
        assert (mask.reshape(P, G, -1).sum((1, 2)) > 0).tolist() == live.tolist()
        # The key is off: no overlong penalty, although completions of 3+ tokens exist.
        assert rec["overlong_penalty_mean"] == 0.0 and rec["overlong_frac"] == 0.0
        # An update replays where the weights moved: always after a full batch's first
        # minibatch; after an all-masked one only if Adam's momentum moves them.
        mine = updates[s * UPDATES:(s + 1) * UPDATES]
        assert rec["replayed_updates"] == sum(u["replayed"] for u in mine)
        if rec["informative_groups"] == P:
            assert [u["replayed"] for u in mine] == [False, True, True, True]
    # The refill ran, and filled batches their first round could not; at the bound of 1 it
    # ran out of rounds, took what the refill found, and masked.
    if refills == REFILLS:
        assert all(r["refill_rounds"] > 0 and r["refilled_groups"] > 0
                   and r["informative_groups"] == P for r in grpo)
    else:
        assert any(r["masked_groups"] > 0 for r in grpo)
        assert any(r["refilled_groups"] > 0 for r in grpo)
    assert sum(r["zero_variance_groups"] for r in grpo) > 0
    # verify_every=2: steps 1 and 3 replayed every round as sampled and found its bits.
    assert [r["replay_verified"] for r in grpo] == [1.0, 0.0, 1.0, 0.0]


@pytest.mark.slow
def test_dynamic_sampling_resumes_exactly(warm_start, tmp_path):
    """The refill rounds draw from the run's prompt stream, whose state the checkpoint keeps."""
    ref, _, _ = _run(warm_start, tmp_path / "ref", _dynamic())
    cut = tmp_path / "cut"
    _run(warm_start, cut, _dynamic(), stop_after=SFT + 2)
    resumed, _, _ = _run(warm_start, cut, _dynamic())
    assert sum(r["refill_rounds"] for r in ref[:2]) > 0  # the cut follows refilled steps
    assert [without_wall_clock(r) for r in resumed] == [without_wall_clock(r) for r in ref]
    ps = []
    for run in (tmp_path / "ref", cut):
        ckpt = Checkpointer(run)
        ps.append(ckpt.manager.restore(ckpt.latest_step())["state"]["params"])
        ckpt.close()
    jax.tree.map(np.testing.assert_array_equal, *ps)


def test_a_refill_round_off_the_samplers_bits_stops_the_verified_step(warm_start, tmp_path,
                                                                      monkeypatch):
    """verify_every replays the refill rounds too: one ulp off in their recorded log-probs
    (every sampler call after the run's first) stops the first GRPO step."""
    real, calls = rollout_queue.generate, []

    def off(*args, **kwargs):
        ro = real(*args, **kwargs)
        calls.append(ro)
        return ro if len(calls) == 1 else dataclasses.replace(
            ro, logprobs=jnp.nextafter(ro.logprobs, 0.0))

    monkeypatch.setattr(rollout_queue, "generate", off)  # where the sampler calls it
    with pytest.raises(ReplayMismatchError, match=rf"at step {SFT} .*grpo.replay=always"):
        _run(warm_start, tmp_path / "run", _dynamic())
    assert len(calls) > 1  # the step refilled before it was verified
