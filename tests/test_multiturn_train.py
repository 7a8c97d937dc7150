"""Multi-turn GRPO in the training program (`train.episodes`, `task.kind=calculator`).

Environments that fail end their episodes with a recorded reason and leave the others
as they were; `jaxrl-lp train --config configs/multiturn_tools.py` runs end to end with
every GRPO step's rollout replayed bit for bit; options episodes do not support yet are
refused with one line; `jaxrl-lp bench multiturn` prints its JSON.
"""

import dataclasses
import json
import time

import jax
import numpy as np
import pytest
from helpers import FAIR_CAST, GRPO_MOVES, assert_bit_equal, checkpoints

from jaxrl_lp.cli.main import main
from jaxrl_lp.envs import CalculatorTask, EnvRunner
from jaxrl_lp.envs.calculator import CalculatorEnv
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.model import init_params
from jaxrl_lp.numerics.policy import FP32
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.rollout.step import LoopSpec
from jaxrl_lp.train.episodes import episode_metrics, sample_episodes

MODEL = ModelConfig(family="qwen3", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=16, intermediate_size=64, loop_steps=1, max_position_embeddings=64)


class Failing(CalculatorEnv):
    """A calculator episode whose every call raises (`raise`) or hangs (`hang`)."""

    def __init__(self, task, how):
        super().__init__(task)
        self.how, self.calls = how, 0

    def step(self, turn):
        self.calls += 1
        if self.how == "raise":
            raise ZeroDivisionError("tool crashed")
        if self.how == "hang":
            time.sleep(3.0)
        return super().step(turn)


class FailingTask(CalculatorTask):
    """Rows 0 and 1 of each batch fail (raise, hang); the rest are plain calculators."""

    def make_env(self):
        self._made = getattr(self, "_made", 0) + 1
        how = {1: "raise", 2: "hang"}.get(self._made, None)
        return Failing(self, how) if how else CalculatorEnv(self)


def _episodes(task, runner):
    params = init_params(MODEL.replace(vocab_size=task.tokenizer.vocab_size),
                         jax.random.PRNGKey(0))
    cfg = MODEL.replace(vocab_size=task.tokenizer.vocab_size)
    return sample_episodes(params, cfg, task, [task.train[i] for i in range(3)], group_size=2,
                           policy=FP32, sampling=SamplingConfig(greedy=True), loop=LoopSpec(),
                           key=jax.random.PRNGKey(1), runner=runner)


def test_an_environment_that_raises_or_hangs_ends_its_episode_and_nothing_else():
    # A failure reward no calculator episode earns (its rewards are 0 and 1).
    runner = EnvRunner(timeout_s=0.5, failure_reward=-1.0)
    clean = _episodes(CalculatorTask(max_turns=3), runner)
    failing = _episodes(FailingTask(max_turns=3), runner)
    assert failing.reasons[0] == "error: ZeroDivisionError: tool crashed"
    assert failing.reasons[1] == "timeout"
    assert failing.rewards[0] == failing.rewards[1] == -1.0
    assert failing.turn_rewards[0].tolist() == failing.turn_rewards[1].tolist() == [-1.0, 0, 0]
    assert failing.turns[0] == failing.turns[1] == 1
    m = episode_metrics(failing)
    assert m["env_failed"] == 2.0 and m["timing_s/env"] >= 0.5
    # The other episodes: the same turns, tokens, rewards and reasons as without failures.
    for r in range(2, 6):
        assert failing.reasons[r] == clean.reasons[r]
        assert failing.rewards[r] == clean.rewards[r]
        n = int((np.asarray(clean.rollout.completion_mask[r])
                 + np.asarray(clean.rollout.env_mask[r])).sum())
        np.testing.assert_array_equal(np.asarray(failing.rollout.completion_tokens[r, :n]),
                                      np.asarray(clean.rollout.completion_tokens[r, :n]))


@pytest.mark.slow
def test_a_training_run_goes_on_past_failing_environments(tmp_path, monkeypatch):
    """A calculator run whose environment raises on some training problems (odd first
    operand; never on the held-out ones): the run takes all its steps, each GRPO record's
    `env_failed` counts the episodes that failed in it, and every step replays bit for bit."""
    from jaxrl_lp.data.pipeline import in_heldout
    from jaxrl_lp.train import apply_overrides, load_config
    from jaxrl_lp.train.program import run_train

    raised = []  # one entry per failed episode: its environment raises at its first turn
    plain = CalculatorEnv.step

    def step(self, turn):
        problem = self.problem
        # `type(self)`: the hung `Failing` env of the test above ends its sleep in here.
        if type(self) is CalculatorEnv and problem.a % 2 and not in_heldout(
                problem.prompt, self.task.heldout_fraction):
            raised.append(problem.prompt)
            raise ZeroDivisionError("tool crashed")
        return plain(self, turn)

    monkeypatch.setattr(CalculatorEnv, "step", step)
    out = tmp_path / "run"
    cfg = apply_overrides(load_config("configs/multiturn_tools.py"), [
        f"run.out_dir={out}", "model.hidden_size=32", "model.num_layers=1",
        "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64",
        "sft.steps=2", "sft.batch_size=8", "grpo.steps=2", "grpo.prompts_per_step=4",
        "grpo.group_size=2", "grpo.verify_every=1", "grpo.start_probe=false",
        "task.failure_reward=-1.0", "run.eval_every=2", "run.eval_size=4",
        "run.checkpoint_every=100", "run.progress=false"])
    summary = run_train(cfg)
    assert summary["grpo_steps"] == 2
    grpo = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["phase"] == "grpo"]
    assert len(grpo) == 2
    assert all(r["replay_verified"] == 1.0 for r in grpo)
    # The failed episodes, all counted; some failed, not all.
    assert sum(r["env_failed"] for r in grpo) == len(raised), ([r["env_failed"] for r in grpo],
                                                                raised)
    assert 0 < len(raised) < 2 * 4 * 2


def test_episodes_of_two_calls_concatenate_and_replay_row_for_row():
    """Dynamic sampling's refilled batch of episodes: rows taken from two calls of different
    slot counts are concatenated (right-padded to the wider, `env_mask` kept), and
    `replay_episodes` (each call replayed whole, its rows taken) is the sampler's bits on
    every policy token; turn credit gives each policy token its turn's advantage from its own
call's groups; a multi-turn and a single-turn rollout do not mix."""
    from jaxrl_lp.rl.advantages import turn_advantages
    from jaxrl_lp.rollout.generate import concat_rollouts, generate, take_rows
    from jaxrl_lp.train.episodes import replay_episodes, turn_credit_advantages

    task = CalculatorTask(max_turns=3)
    cfg = MODEL.replace(vocab_size=task.tokenizer.vocab_size)
    params = init_params(cfg, jax.random.PRNGKey(0))
    runner = EnvRunner(timeout_s=5.0)

    def call(task, records, seed):
        return sample_episodes(params, cfg, task, records, group_size=2, policy=FP32,
                               sampling=SamplingConfig(temperature=1.0), loop=LoopSpec(),
                               key=jax.random.PRNGKey(seed), runner=runner)

    a = call(task, [task.train[i] for i in range(2)], 1)
    b = call(CalculatorTask(max_turns=1), [task.train[i] for i in range(2, 4)], 2)
    assert a.rollout.completion_tokens.shape[1] > b.rollout.completion_tokens.shape[1]
    rows_a, rows_b = np.array([2, 3]), np.array([0, 1, 2, 3])
    ro = concat_rollouts([take_rows(a.rollout, rows_a), take_rows(b.rollout, rows_b)],
                         task.tokenizer.pad_id)
    n = a.rollout.completion_tokens.shape[1]
    assert ro.completion_tokens.shape == (6, n) and ro.env_mask.shape == (6, n)
    np.testing.assert_array_equal(np.asarray(ro.env_mask[:2]), np.asarray(a.rollout.env_mask)[2:])
    assert not np.asarray(ro.env_mask[2:, b.rollout.completion_tokens.shape[1]:]).any()
    got = np.asarray(replay_episodes(params, cfg, FP32, [(a, rows_a), (b, rows_b)]))
    mask = np.asarray(ro.completion_mask) > 0
    assert mask.sum() > 0
    np.testing.assert_array_equal(got[mask], np.asarray(ro.logprobs)[mask])
    # Turn credit: each policy token carries its turn's advantage, from its own call's groups
    # (turn rewards planted on the turns taken: a random model earns none).
    assert a.turns.max() > 1 and (a.turn_rewards.sum(1) == a.rewards).all()
    rng = np.random.default_rng(0)
    planted = [dataclasses.replace(mt, turn_rewards=np.where(
        np.arange(mt.limits.max_turns)[None] < mt.turns[:, None],
        rng.integers(0, 3, mt.turn_rewards.shape), 0).astype(np.float32)) for mt in (a, b)]
    adv = turn_credit_advantages([(planted[0], rows_a), (planted[1], rows_b)], 2, "drgrpo",
                                 0.5, n)
    assert adv.shape == (6, n) and (adv[~mask] == 0).all() and (adv[mask] != 0).any()
    for mt, rows, at in ((planted[0], rows_a, 0), (planted[1], rows_b, 2)):
        turns = mt.token_turns()[rows]
        want = np.asarray(turn_advantages(mt.turn_rewards, mt.turns, 2, "drgrpo", 0.5))[rows]
        pol = np.asarray(mt.rollout.completion_mask)[rows] > 0
        assert ((turns >= 0) == pol).all()  # every policy token has its turn, nothing else
        r_idx, c_idx = np.nonzero(pol)
        np.testing.assert_array_equal(adv[at + r_idx, c_idx], want[r_idx, turns[r_idx, c_idx]])
    single = generate(params, cfg, [task.prompt_ids(task.train[0])], max_new_tokens=4,
                      policy=FP32, key=jax.random.PRNGKey(3))
    with pytest.raises(ValueError, match="multi-turn rollout .* and a single-turn one"):
        concat_rollouts([a.rollout, single], task.tokenizer.pad_id)


# The README's multi-turn command end to end, in the slow tier: the default suite stays
# under 15 minutes cold on 2 cores.
@pytest.mark.slow
def test_train_runs_multiturn_episodes_and_replays_every_step(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--config", "configs/multiturn_tools.py",
                 "--set", f"run.out_dir={out}", "--set", "sft.steps=20",
                 "--set", "grpo.steps=2", "--set", "grpo.prompts_per_step=4",
                 "--set", "grpo.group_size=2", "--set", "grpo.verify_every=1",
                 "--set", "run.eval_size=8", "--set", "run.eval_every=1"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in records if r["phase"] == "grpo"]
    assert len(grpo) == 2
    for r in grpo:
        assert r["replay_verified"] == 1.0  # the replay equalled the sampler's bits
        assert r["turns_per_episode"] >= 1.0 and r["policy_tokens"] > 0
        for key in ("tool_calls", "tool_success", "tool_use", "tool_solved", "env_tokens",
                    "env_failed", "timing_s/env"):
            assert key in r, key
    summary = json.loads((out / "summary.json").read_text())
    assert summary["grpo_steps"] == 2


@pytest.mark.parametrize("setting,words", [
    ("grpo.reuse_products=true", ["task.kind='calculator'", "grpo.reuse_products=false"]),
    ("distributed.num_processes=2", ["distributed.num_processes=1", "run.learner_mesh=''"]),
    ("grpo.overlong_buffer=2", ["grpo.overlong_buffer=0"]),
    ("sft.optimizer=error_diffusion:ternary", ["sft.optimizer=adamw"])])
def test_options_episodes_do_not_support_are_refused_in_one_line(tmp_path, capsys, setting,
                                                                    words):
    assert main(["train", "--config", "configs/multiturn_tools.py",
                 "--set", f"run.out_dir={tmp_path / 'r'}", "--set", setting]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err
    assert not (tmp_path / "r").exists()


def test_the_start_probe_samples_episodes_and_stops_a_planted_mismatch(tmp_path, monkeypatch,
                                                                        capsys):
    """A multi-turn run's start probe samples a call of episodes at the run's shapes and
    replays it whole: as built, every policy token is the sampler's bits; with a replay one
    ulp off, `jaxrl-lp train` exits 2 with one line and nothing is written."""
    import jax.numpy as jnp

    import jaxrl_lp.train.probe as probe
    from jaxrl_lp.train import apply_overrides, load_config
    from jaxrl_lp.train.validate import validate

    small = ["grpo.prompts_per_step=4", "grpo.group_size=2"]
    cfg = apply_overrides(load_config("configs/multiturn_tools.py"),
                          [*small, f"run.out_dir={tmp_path / 'ok'}"])
    checked = probe.probe_exactness(cfg, validate(cfg))
    assert checked["rows"] == 8 and checked["slices"] == [] and checked["tokens"] > 8
    real = probe.replay_multiturn
    monkeypatch.setattr(probe, "replay_multiturn",
                        lambda *a, **k: jnp.nextafter(real(*a, **k), 0.0))
    out = tmp_path / "run"
    assert main(["train", "--config", "configs/multiturn_tools.py",
                 *[x for kv in small for x in ("--set", kv)],
                 "--set", f"run.out_dir={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "a call of episodes" in err and "grpo.replay=always" in err and \
        "nothing was written" in err, err
    assert not out.exists()


def test_bench_multiturn_prints_its_json(tmp_path):
    out = tmp_path / "mt.json"
    assert main(["bench", "multiturn", "--rows", "2", "--turns", "2", "--turn-tokens", "4",
                 "--observation-tokens", "2", "--env-ms", "1", "--repeats", "1",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["multiturn"]["replay_max_abs_dlogp"] == 0.0
    assert res["multiturn"]["env_seconds"] > 0 and res["single_turn"]["tokens"] > 0
    assert main(["bench", "multiturn", "--rows", "0"]) != 0


def test_the_gsm8k_tools_config_loads_and_names_its_missing_files(tmp_path, capsys):
    from jaxrl_lp.train import load_config

    cfg = load_config("configs/grpo_gsm8k_tools_qwen3_0p6b.py")
    assert cfg.task.kind == "gsm8k_tools" and cfg.task.multiturn
    assert cfg.grpo.policies.matched and cfg.run.mesh == ""
    assert main(["train", "--config", "configs/grpo_gsm8k_tools_qwen3_0p6b.py",
                 "--set", f"run.out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()  # the checkpoint is not here: named, nothing written
    assert len(err.splitlines()) == 1 and "checkpoints/Qwen3-0.6B" in err, err
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    pytest.param([*FAIR_CAST, *GRPO_MOVES], id="fair_cast_kl"),
    pytest.param(["lora.rank=4", "lora.alpha=8.0", *GRPO_MOVES], id="lora_kl"),
    pytest.param(["grpo.dynamic_sampling=true", "grpo.verify_every=1", *GRPO_MOVES],
                 id="dynamic_sampling_kl"),
    pytest.param(["grpo.max_staleness=1", "grpo.verify_every=1", *GRPO_MOVES],
                 id="offpolicy_kl")])
def test_a_multiturn_run_stopped_and_resumed_ends_bit_identical(tmp_path, options):
    """Stopped after its first GRPO checkpoint and resumed, a calculator run ends with the
    state and records of the run that was not stopped, and its GRPO steps moved the weights.
    With a KL term to the GRPO start, and a bf16 error-feedback served copy (Fair Cast: the
    resume reads the exporter's residual from the checkpoint), LoRA adapters (the base read
    back from the run directory), dynamic sampling (batches refilled from further calls,
    the prompt stream's state covering them) or off-policy episodes (sampled a step
    before the one that learns from them: the checkpoint holds the weights of the call in
    flight, which the resume samples again): the resume reads the reference from the run
    directory, the KL term is live, and the verified steps replay bit for bit (a stale
    call at its own weights)."""
    from jaxrl_lp.train import apply_overrides, load_config
    from jaxrl_lp.train.program import run_train

    def cfg(out):
        return apply_overrides(load_config("configs/multiturn_tools.py"), [
            f"run.out_dir={out}", "task.ops=+", "task.max_digits=1", "task.second_digits=1",
            "sft.steps=40", "grpo.steps=4", "grpo.prompts_per_step=4", "grpo.group_size=4",
            "grpo.lr=1e-2", "run.checkpoint_every=42", "run.eval_every=2", "run.eval_size=8",
            "grpo.verify_every=2", "run.progress=false", *options])

    whole = run_train(cfg(tmp_path / "whole"))
    run_train(cfg(tmp_path / "cut"), stop_after=42)
    resumed = run_train(cfg(tmp_path / "cut"))
    assert resumed["final_accuracy"] == whole["final_accuracy"]
    a, b = checkpoints(tmp_path / "whole"), checkpoints(tmp_path / "cut")
    assert sorted(a) == sorted(b) and 44 in a
    assert_bit_equal(a[44]["state"], b[44]["state"])
    # GRPO moved the weights between the checkpoints the resume compares.
    moved = jax.tree.map(lambda x, y: bool(np.any(np.asarray(x) != np.asarray(y))),
                         a[42]["state"]["params"], a[44]["state"]["params"])
    assert any(jax.tree.leaves(moved))

    def records(d):
        return [{k: v for k, v in r.items() if not k.startswith("timing") and "per_s" not in k}
                for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())]

    assert records(tmp_path / "whole") == records(tmp_path / "cut")
    grpo = [r for r in records(tmp_path / "whole") if r["phase"] == "grpo"]
    verified = grpo if "grpo.verify_every=1" in options else grpo[::2]  # else every 2nd
    assert all(r["replay_verified"] == 1.0 for r in verified)
    assert max(r["kl_ref"] for r in grpo) > 0
    if "lora.rank=4" in options:  # the checkpoints hold the adapters; the base stands still
        assert set(a[44]["state"]["params"]) == {"adapters"}
    elif "grpo.dynamic_sampling=true" in options:  # a verified batch joined several calls
        assert any(r["refilled_groups"] > 0 for r in grpo)
    elif "grpo.max_staleness=1" in options:  # every step after the first learned a stale call
        assert [r["rollout_staleness"] for r in grpo] == [0.0, 1.0, 1.0, 1.0]
        # ... and the weights had moved since the call's: a policy change the learner measured
        assert max(r["offpolicy_max_abs_dlogp"] for r in grpo[1:]) > 0
    else:
        assert all("served_master_k3" in r for r in grpo)


@pytest.mark.slow
def test_a_multiturn_run_on_a_mesh_is_the_one_device_run_with_exact_replays(tmp_path):
    """`run.mesh=data=2,fsdp=2,tensor=2` with episodes: the warm-start's losses are the
    one-device run's (to rounding), every GRPO step (dynamic sampling on) replays bit for
    bit on the mesh, and the checkpoint restores sharded over it."""
    from jaxrl_lp.train import apply_overrides, load_config
    from jaxrl_lp.train.checkpoint import Checkpointer
    from jaxrl_lp.train.program import initial_state, run_train

    def run(name, mesh):
        cfg = apply_overrides(load_config("configs/multiturn_tools.py"), [
            f"run.out_dir={tmp_path / name}", f"run.mesh={mesh}", "task.ops=+",
            "task.max_digits=1", "task.second_digits=1", "sft.steps=6", "sft.batch_size=16",
            "grpo.steps=2", "grpo.prompts_per_step=4", "grpo.group_size=4",
            "grpo.dynamic_sampling=true", "grpo.verify_every=1", "run.eval_every=2",
            "run.eval_size=4", "run.progress=false"])
        run_train(cfg)
        return cfg, [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text()
                     .splitlines()]

    _, one = run("one", "")
    cfg, mesh = run("mesh", "data=2,fsdp=2,tensor=2")
    sft = [(a, b) for a, b in zip(one, mesh, strict=True) if a["phase"] == "sft"]
    assert len(sft) == 6
    for a, b in sft:
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)
    grpo = [r for r in mesh if r["phase"] == "grpo"]
    assert len(grpo) == 2 and all(r["replay_verified"] == 1.0 and
                                  r["mismatch_max_abs_dlogp"] == 0.0 for r in grpo)
    plan, like, _ = initial_state(cfg)
    ckpt = Checkpointer(cfg.run.out_dir)
    try:
        state, _ = ckpt.restore(like.tree(), plan.model)
    finally:
        ckpt.close()
    big = [x for x in jax.tree.leaves(state["params"]) if x.size > 64]
    assert big and all(all(s.data.shape != x.shape for s in x.addressable_shards) for x in big)
