"""A user's own task through the trainer's public paths (`task.kind=dataset`, `run_train(cfg,
task=...)`, a config file's `TASK`), exact as the built-in tasks.

The user's files live in a temporary directory outside the repository: a JSONL of records
and a module of reward functions with TRL's signature, imported by path
(`task.rewards=mymod:fn`). Each run here is a few steps of the tiny model; the run that
shows learning is `test_own_task_learns.py` (the slow tier).
"""

import json

import numpy as np
import pytest
from helpers import TINY_MODEL, sets

from jaxrl_lp.cli.main import main as cli_main
from jaxrl_lp.tasks import DatasetTask, check_task, task_fingerprint
from jaxrl_lp.train import apply_overrides, default_config, run_train

REWARD_MODULE = '''
def correct(prompts, completions, answer, **kwargs):
    """1 where the completion is the answer (TRL's signature: lists, one value per row)."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def short(completions, **kwargs):
    """A length bonus that does not apply (None) to empty completions."""
    return [None if not c else 1.0 / len(c) for c in completions]


def raises(completions, **kwargs):
    raise KeyError("no column 'solution'")


def too_few(completions, **kwargs):
    return [0.0]


def nan(completions, **kwargs):
    return [float("nan")] * len(completions)
'''


def write_sums(path, n=300, seed=0, prompt_key="question", answer_key="solution"):
    """Two-digit sums as a user writes them: `{"question": "12+30=", "solution": "42"}`."""
    rs = np.random.RandomState(seed)
    with open(path, "w") as f:
        for a, b in rs.randint(0, 100, (n, 2)):
            f.write(json.dumps({prompt_key: f"{a}+{b}=", answer_key: str(a + b),
                                "level": int(a + b > 99)}) + "\n")
    return path


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A user's directory: data and a reward module on sys.path (as PYTHONPATH puts it)."""
    d = tmp_path / "user"
    d.mkdir()
    (d / "myrewards.py").write_text(REWARD_MODULE)
    write_sums(d / "sums.jsonl")
    monkeypatch.syspath_prepend(str(d))
    return d


def _dataset_sets(d, *more):
    return [*TINY_MODEL, "task.kind=dataset", f"task.path={d / 'sums.jsonl'}",
            "task.prompt_key=question", "task.answer_key=solution",
            "task.rewards=myrewards:correct,myrewards:short=0.1", "sft.steps=2",
            "sft.batch_size=8", "grpo.steps=2", "grpo.prompts_per_step=2", "grpo.group_size=2",
            "grpo.verify_every=1", "run.eval_size=4", "run.progress=false",
            "model.max_position_embeddings=32", *more]


def _records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_users_jsonl_and_reward_module_train_through_the_cli(user_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert cli_main(["train", *sets(*_dataset_sets(user_dir, f"run.out_dir={run}"))]) == 0
    grpo = [r for r in _records(run) if r["phase"] == "grpo"]
    assert len(grpo) == 2
    for r in grpo:  # each function's mean, none failed, every step replayed and exact
        assert 0.0 <= r["reward/correct"] <= 1.0 and r["reward_failed/correct"] == 0.0
        assert r["reward/short"] > 0.0 and r["reward_failed/short"] == 0.0
        assert r["replay_verified"] == 1.0 and r["mismatch_max_abs_dlogp"] == 0.0
    record = json.loads((run / "task.json").read_text())
    assert record["type"] == "jaxrl_lp.tasks.dataset.DatasetTask"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4
    capsys.readouterr()
    assert cli_main(["eval", "--run", str(run)]) == 0  # the run's config.json builds the task
    assert json.loads(capsys.readouterr().out)["accuracy"] == summary["final_accuracy"]


def test_a_resumed_run_refuses_another_task(user_dir, tmp_path, capsys):
    run = tmp_path / "run"
    cfg = apply_overrides(default_config(), _dataset_sets(user_dir, f"run.out_dir={run}"))
    run_train(cfg, stop_after=3)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    write_sums(user_dir / "other.jsonl", seed=1)
    args = sets(*_dataset_sets(user_dir, f"run.out_dir={run}",
                               f"task.path={user_dir / 'other.jsonl'}"))
    assert cli_main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "trains another task" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    # the same task resumes and finishes
    assert run_train(cfg)["steps"] == 4


@pytest.mark.parametrize("override,message", [
    ("task.path=/nonexistent/sums.jsonl", "task.path='/nonexistent/sums.jsonl' does not exist"),
    ("task.prompt_key=prompt", "task.prompt_key='prompt': the records has no such column"),
    ("task.rewards=nomodule:fn", "task.rewards"),
    ("task.rewards=myrewards:missing", "missing"),
    ("task.rewards=myrewards:raises", "raises"),
    ("task.rewards=myrewards:too_few", "too_few"),
    ("task.rewards=myrewards:nan", "nan"),
    ("task.rewards=no_such_builtin", "no_such_builtin"),
    ("task.heldout=/nonexistent/test.jsonl", "task.heldout"),
    ("task.env=myrewards:nothing_here", "task.env"),
])
def test_each_bad_input_is_one_line_and_writes_nothing(user_dir, tmp_path, capsys, override,
                                                       message):
    run = tmp_path / "run"
    assert cli_main(["train", *sets(*_dataset_sets(user_dir, f"run.out_dir={run}"),
                                    override)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err, err
    assert len(err.splitlines()) == 1, err
    assert not run.exists()


class NotATask:
    """An object that looks like a task to nobody."""

    tokenizer = None


def test_run_train_takes_a_task_object_and_names_what_one_lacks(user_dir, tmp_path):
    from jaxrl_lp.tasks import load_records
    from jaxrl_lp.tasks.dataset import char_tokenizer_for
    from jaxrl_lp.tasks.rewards import parse_rewards

    records = load_records(user_dir / "sums.jsonl")["train"]
    tok = char_tokenizer_for([r["question"] + r["solution"] for r in records])
    task = DatasetTask(records, tok, parse_rewards("myrewards:correct"), prompt_key="question",
                       answer_key="solution")
    assert check_task(task, needs_sft=True) is task
    # the plain format: BOS once, then the prompt's text; the completion, then EOS
    record = task.train[0]
    assert task.prompt_ids(record) == tok.encode(record["question"], add_bos=True)
    assert task.sft_example(record)[1] == tok.encode(record["solution"], add_eos=True)
    assert task_fingerprint(task) == task_fingerprint(
        DatasetTask(records, tok, parse_rewards("myrewards:correct"), prompt_key="question",
                    answer_key="solution"))
    run = tmp_path / "run"
    cfg = apply_overrides(default_config(), [o for o in _dataset_sets(user_dir, f"run.out_dir={run}")
                                             if not o.startswith("task.")])
    summary = run_train(cfg, task)
    assert summary["steps"] == 4
    grpo = [r for r in _records(run) if r["phase"] == "grpo"]
    assert all(r["replay_verified"] == 1.0 and r["mismatch_max_abs_dlogp"] == 0.0 for r in grpo)
    with pytest.raises(ValueError, match="NotATask is not a single-turn task: it lacks train"):
        run_train(apply_overrides(cfg, [f"run.out_dir={tmp_path / 'other'}"]), NotATask())
    assert not (tmp_path / "other").exists()


CONFIG_FILE = '''
from jaxrl_lp.tasks import DatasetTask, load_records, char_tokenizer_for, parse_rewards
from jaxrl_lp.train import apply_overrides, default_config

records = load_records({path!r})["train"]
TASK = DatasetTask(records, char_tokenizer_for([r["question"] + r["solution"] for r in records]),
                   parse_rewards("myrewards:correct"), prompt_key="question", answer_key="solution")
CONFIG = apply_overrides(default_config(), {sets!r})
'''


def test_a_config_file_defines_the_task_and_eval_finds_it_again(user_dir, tmp_path, capsys):
    run = tmp_path / "run"
    overrides = [o for o in _dataset_sets(user_dir, f"run.out_dir={run}")
                 if not o.startswith("task.")]
    config = user_dir / "my_task.py"
    config.write_text(CONFIG_FILE.format(path=str(user_dir / "sums.jsonl"), sets=overrides))
    assert cli_main(["train", "--config", str(config)]) == 0
    capsys.readouterr()
    assert json.loads((run / "task.json").read_text())["config_file"] == str(config)
    assert cli_main(["eval", "--run", str(run), "--samples", "4", "--size", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"accuracy", "mean@4", "pass@1", "pass@2", "pass@4"}
    assert out["pass@1"] == pytest.approx(out["mean@4"]) and out["pass@4"] >= out["pass@2"]


FLAKY = '''
def flaky(completions, solution, **kwargs):
    """Raises on any batch holding a wrong completion: never on the reference answers."""
    if any(c.strip() != s for c, s in zip(completions, solution)):
        raise RuntimeError("grader crashed")
    return [1.0] * len(completions)
'''


def test_a_reward_that_fails_during_the_run_is_a_counted_failure_reward(user_dir, tmp_path,
                                                                         capsys):
    """Past the start probe (where the reference answers pass), a reward function that raises
    gives its samples task.failure_reward, counted, with a line on stderr; the run goes on."""
    (user_dir / "flakyrewards.py").write_text(FLAKY)
    run = tmp_path / "run"
    cfg = apply_overrides(default_config(), _dataset_sets(
        user_dir, f"run.out_dir={run}", "task.rewards=flakyrewards:flaky",
        "task.failure_reward=-1", "task.completion_key=solution"))
    assert run_train(cfg)["steps"] == 4
    grpo = [r for r in _records(run) if r["phase"] == "grpo"]
    assert sum(r["reward_failed/flaky"] for r in grpo) == 8  # every sample of both batches
    assert all(r["reward_mean"] == -1.0 for r in grpo)  # the failure reward, not a silent 0
    assert "reward function 'flaky' failed on 4 of 4 samples" in capsys.readouterr().err


SLOW = [pytest.mark.slow]


@pytest.mark.parametrize("features", [
    pytest.param(["grpo.max_staleness=1"], id="offpolicy"),  # the sampler one step ahead
    pytest.param(["lora.rank=4"], id="lora", marks=SLOW),  # adapters on a frozen base
    # the 8 simulated devices, 8 prompts of 2 samples over the 8 data shards
    pytest.param(["run.mesh=data=2,fsdp=4", "grpo.prompts_per_step=8"], id="mesh", marks=SLOW),
])
def test_a_task_object_composes_with_the_trainers_features(user_dir, tmp_path, features):
    from jaxrl_lp.tasks import load_records, parse_rewards
    from jaxrl_lp.tasks.dataset import char_tokenizer_for

    records = load_records(user_dir / "sums.jsonl")["train"]
    task = DatasetTask(records, char_tokenizer_for([r["question"] + r["solution"] for r in records]),
                       parse_rewards("myrewards:correct"), prompt_key="question",
                       answer_key="solution")
    run = tmp_path / "run"
    cfg = apply_overrides(default_config(), [
        *(o for o in _dataset_sets(user_dir, f"run.out_dir={run}") if not o.startswith("task.")),
        "run.checkpoint_every=3", *features])
    assert run_train(cfg, task, stop_after=3)["interrupted"]
    assert run_train(cfg, task)["steps"] == 4  # resumed from step 3
    grpo = [r for r in _records(run) if r["phase"] == "grpo"]
    assert [r["step"] for r in grpo] == [3, 4] and all("reward/correct" in r for r in grpo)
    verified = [r for r in grpo if r["replay_verified"] == 1.0]
    assert verified and all(r.get("mismatch_max_abs_dlogp", 0.0) == 0.0 for r in verified)
