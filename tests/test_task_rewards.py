"""Reward functions by import path (`jaxrl_lp.tasks.rewards`, `jaxrl_lp.tasks.imports`): TRL's
signature, None for "does not apply", weights, each failure kind (strict at the start probe,
else a counted failure reward), the built-ins and math-verify's own verdicts."""

import re
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from jaxrl_lp.tasks.imports import load_object
from jaxrl_lp.tasks.rewards import (
    BUILTIN_REWARDS,
    RewardBatch,
    RewardFunction,
    RewardScorer,
    parse_rewards,
)

FAIL = -1.0  # no function here returns it: a silent zero or a dropped sample cannot pass


# Reward functions written as TRL's GRPOTrainer documentation shows them.
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_func(completions, ground_truth, **kwargs):
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]  # noqa: B905 - as TRL writes it


def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for completion, t in zip(completions, task):  # noqa: B905 - as TRL writes it
        if t == "math":
            rewards.append(1.0 if "42" in completion else 0.0)
        else:
            rewards.append(None)  # does not apply
    return rewards


def _batch(texts, **columns):
    n = len(texts)
    return dict(prompts=[f"p{i}" for i in range(n)], completions=list(texts),
                completion_ids=[[i, i + 1] for i in range(n)], columns=columns)


def test_trl_documented_functions_run_unchanged_with_its_keywords():
    seen = {}

    def spy(prompts, completions, completion_ids, trainer_state, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids,
                    trainer_state=trainer_state, kwargs=kwargs,
                    main=threading.current_thread() is threading.main_thread())
        return [0.0] * len(completions)

    def names_only(prompts, completions, answer):  # no **kwargs: gets only what it names
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    scorer = RewardScorer([reward_len, reward_func, spy, names_only])
    texts = ["x" * 20, r"so \boxed{7}", r"\boxed{8}"]
    b = scorer.score(**_batch(texts, ground_truth=["1", "7", "9"], answer=["x" * 20, "?", "?"]),
                     trainer_state="STATE")
    assert b.parts["reward_len"].tolist() == [0.0, -8.0, -11.0]
    assert b.parts["reward_func"].tolist() == [0.0, 1.0, 0.0]
    assert b.parts["names_only"].tolist() == [1.0, 0.0, 0.0]
    assert b.failed == {"reward_len": 0, "reward_func": 0, "spy": 0, "names_only": 0}
    assert seen["prompts"] == ["p0", "p1", "p2"] and seen["completions"] == texts
    assert seen["completion_ids"] == [[0, 1], [1, 2], [2, 3]]
    assert seen["trainer_state"] == "STATE"
    assert seen["kwargs"] == {"ground_truth": ["1", "7", "9"], "answer": ["x" * 20, "?", "?"]}
    assert not seen["main"]  # on a host thread of its own
    np.testing.assert_array_equal(b.total_B, np.float32([1.0, -7.0, -11.0]))
    assert b.total_B.dtype == np.float32


def test_a_chat_task_passes_completions_as_assistant_messages():
    scorer = RewardScorer([format_reward_func])
    prompts = [[{"role": "user", "content": "q"}]] * 2
    completions = ["<think>a</think><answer>b</answer>", "b"]
    b = scorer.score(prompts, completions, [[1], [2]], {}, strict=True)
    assert b.parts["format_reward_func"].tolist() == [1.0, 0.0]
    # Already in TRL's form: passed as is.
    wrapped = [[{"role": "assistant", "content": c}] for c in completions]
    b = scorer.score(prompts, wrapped, [[1], [2]], {}, strict=True)
    assert b.parts["format_reward_func"].tolist() == [1.0, 0.0]


def test_none_is_left_out_of_the_total_and_the_mean_and_weights_scale():
    def half(completions, **kwargs):
        return [0.5, None, 0.5, None]

    def never(completions, **kwargs):
        return [None] * len(completions)

    scorer = RewardScorer([RewardFunction("math", math_reward_func, 2.0),
                           RewardFunction("half", half, -1.0), never])
    b = scorer.score(**_batch(["42", "42", "0", "x"], task=["math", "code", "math", "code"]))
    np.testing.assert_array_equal(b.parts["math"], np.float32([1.0, np.nan, 0.0, np.nan]))
    # Rows 1 and 3: every function skips them -> 0.0.
    np.testing.assert_array_equal(b.total_B, np.float32([1.5, 0.0, -0.5, 0.0]))
    assert b.failed == {"math": 0, "half": 0, "never": 0}  # None is not a failure
    m = b.metrics()
    assert m["reward/math"] == 0.5 and m["reward/half"] == 0.5 and m["reward/never"] == 0.0
    assert m["reward_failed/math"] == 0.0
    assert set(m) == {f"reward{s}/{n}" for s in ("", "_failed") for n in ("math", "half", "never")}


def test_functions_run_once_per_batch_all_at_once():
    calls = []

    def slow_a(completions, **kwargs):
        calls.append("a")
        time.sleep(0.4)
        return [1.0] * len(completions)

    def slow_b(completions, **kwargs):
        calls.append("b")
        time.sleep(0.4)
        return [2.0] * len(completions)

    t0 = time.perf_counter()
    b = RewardScorer([slow_a, slow_b], timeout_s=5.0).score(**_batch(["x"] * 6))
    took = time.perf_counter() - t0
    assert sorted(calls) == ["a", "b"]
    assert took < 0.75, took  # one after the other would take 0.8 s
    assert b.total_B.tolist() == [3.0] * 6 and b.seconds == pytest.approx(took, abs=0.1)


@pytest.fixture
def release():
    """Unblocks the timed-out functions a test leaves behind when it ends."""
    event = threading.Event()
    yield event
    event.set()


def _failing(kind, release):
    """A function that fails the way `kind` says on the sample whose text is 'bad'; the
    per-batch kinds fail on the whole batch."""
    def bad_fn(completions, **kwargs):
        if kind == "raises":
            raise KeyError("boom")
        if kind == "times out":
            release.wait(20)
        if kind == "wrong count":
            return [1.0] * (len(completions) - 1)
        if kind == "not a list":
            return 1.0
        bad = {"nan": float("nan"), "inf": float("inf"), "string": "1.0"}[kind]
        return [bad if c == "bad" else 1.0 for c in completions]
    return bad_fn


_WHY = {"raises": "raised KeyError: 'boom'", "times out": "did not return within 0.2 s",
        "wrong count": "returned 3 values for 4 completions",
        "not a list": "returned float, not a list of 4 values",
        "nan": "returned the non-finite value nan", "inf": "returned the non-finite value inf",
        "string": "returned str '1.0', not a number"}
_KINDS = list(_WHY)
_PER_SAMPLE = {"nan", "inf", "string"}


@pytest.mark.parametrize("kind", _KINDS)
def test_a_failure_is_a_counted_failure_reward_and_one_stderr_line(kind, release, capsys):
    scorer = RewardScorer([RewardFunction("bad_fn", _failing(kind, release), 1.0),
                           reward_len], timeout_s=0.2, failure_reward=FAIL)
    t0 = time.perf_counter()
    b = scorer.score(**_batch(["ok", "bad", "ok", "bad"]), describe=lambda i: f"record #{i}")
    assert time.perf_counter() - t0 < 2.0  # a hung function is left behind
    failed = [1, 3] if kind in _PER_SAMPLE else [0, 1, 2, 3]
    want = np.float32([FAIL if i in failed else 1.0 for i in range(4)])
    np.testing.assert_array_equal(b.parts["bad_fn"], want)
    assert b.failed == {"bad_fn": len(failed), "reward_len": 0}
    np.testing.assert_array_equal(b.total_B, want + b.parts["reward_len"])
    np.testing.assert_array_equal(b.parts["reward_len"], np.float32([-18.0, -17.0] * 2))
    assert b.metrics()["reward_failed/bad_fn"] == len(failed)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines  # one line per function per batch
    assert lines[0] == (f"reward function 'bad_fn' failed on {len(failed)} of 4 samples: "
                        f"{_WHY[kind]} (first failing: record #{failed[0]}); each scored -1, "
                        "counted in reward_failed/bad_fn")


@pytest.mark.parametrize("kind", _KINDS)
def test_a_failure_at_the_start_probe_is_raised_in_one_line(kind, release, capsys):
    scorer = RewardScorer([reward_len, RewardFunction("bad_fn", _failing(kind, release), 1.0)],
                          timeout_s=0.2, failure_reward=FAIL)
    with pytest.raises(ValueError) as e:
        scorer.score(**_batch(["ok", "bad", "ok", "bad"]), strict=True,
                     describe=lambda i: f"record #{i}")
    first = 1 if kind in _PER_SAMPLE else 0
    assert str(e.value) == (f"reward function 'bad_fn' failed on {2 if first else 4} of 4 "
                            f"samples: {_WHY[kind]} (first failing: record #{first})")
    assert capsys.readouterr().err == ""


def test_a_function_that_exits_or_names_a_missing_column_is_reported():
    def exits(completions, **kwargs):
        sys.exit(3)

    def needs(completions, solution):
        return [1.0] * len(completions)

    b = RewardScorer([exits, needs], timeout_s=5.0, failure_reward=FAIL).score(**_batch(["a"]))
    assert b.parts["exits"].tolist() == [FAIL] and b.parts["needs"].tolist() == [FAIL]
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"'exits' failed on 1 of 1 samples: raised SystemExit: 3"):
        RewardScorer([exits], timeout_s=5.0).score(**_batch(["a"]), strict=True)
    assert time.perf_counter() - t0 < 2.0  # reported at once, not as a hang
    with pytest.raises(ValueError, match=r"'needs' failed .* raised TypeError: .*'solution'"):
        RewardScorer([needs]).score(**_batch(["a"]), strict=True)


def test_an_async_function_is_awaited():
    async def async_len(completions, **kwargs):
        return [float(len(c)) for c in completions]

    b = RewardScorer([async_len]).score(**_batch(["ab", "abc"]), strict=True)
    assert b.parts["async_len"].tolist() == [2.0, 3.0]


def test_bad_inputs_to_score_and_the_scorer_are_one_line():
    scorer = RewardScorer([reward_len])
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 2 completions"):
        scorer.score(**_batch(["a", "b"], answer=["1"]))
    with pytest.raises(ValueError, match="a column named 'completions' would replace"):
        scorer.score(**_batch(["a"], completions=["1"]))
    with pytest.raises(ValueError, match="1 prompts, 2 completions"):
        scorer.score(["p"], ["a", "b"], [[1], [2]], {})
    with pytest.raises(ValueError, match="timeout_s=0"):
        RewardScorer([reward_len], timeout_s=0)
    with pytest.raises(ValueError, match="failure_reward=nan"):
        RewardScorer([reward_len], failure_reward=float("nan"))
    with pytest.raises(ValueError, match="share a name"):
        RewardScorer([reward_len, RewardFunction("reward_len", reward_func)])


def _score(spec, texts, answers, **kw):
    scorer = RewardScorer(parse_rewards(spec, **kw), failure_reward=FAIL)
    return scorer.score(**_batch(texts, answer=answers), strict=True).parts[spec.split("=")[0]]


def test_exact_and_number_match():
    texts = [" 42\n", "42.0", "#### 1,234", "The answer is $5.", "7", "x"]
    answers = ["42", "42", "1234", "5", None, "x"]
    assert _score("exact_match", texts, answers).tolist()[:4] == [1.0, 0.0, 0.0, 0.0]
    assert np.isnan(_score("exact_match", texts, answers)[4])  # no answer: does not apply
    assert _score("number_match", texts, [*answers[:4], None, "3"]).tolist()[:4] == [1.0] * 4
    assert _score("number_match", ["12 #### 13", "13"], ["#### 12", "13"]).tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="exact_match needs the reference answers .*task.answer_key"):
        RewardScorer(parse_rewards("exact_match")).score(**_batch(["a"]), strict=True)


def test_format_checks():
    texts = ["<think>why</think>42", "  <think>\na\n</think>\n 7 ", "<think>why</think>  ",
             "42", "<think>a<think>b</think>c", "<think>a</think>b</think>"]
    assert _score("think_format", texts, [None] * 6).tolist() == [1, 1, 0, 0, 0, 0]
    got = _score("regex_format", ["<a>1</a>", "<a>1\n2</a>", "x<a>1</a>"], [None] * 3,
                 format_regex=r"<a>.+</a>")
    assert got.tolist() == [1.0, 1.0, 0.0]  # DOTALL, the whole completion
    with pytest.raises(ValueError, match="^task.rewards: regex_format needs a pattern: set "
                                         "task.format_regex$"):
        parse_rewards("regex_format")
    with pytest.raises(ValueError, match="is not a valid regular expression"):
        parse_rewards("regex_format", format_regex="(")


def test_math_verify_equals_its_own_verdicts():
    from math_verify import parse, verify

    pairs = [("0.5", r"\boxed{\frac{1}{2}}"), ("2", "$x=2$"), ("2", r"$\sqrt{4}$"),
             ("2", r"\sqrt{4}"), ("3", r"The answer is $\boxed{4}$"), ("42.0", "42"),
             (r"\frac{1}{3}", "0.3333"), ("x^2+1", "$1+x^2$")]
    want = [float(verify(parse(gold), parse(pred))) for gold, pred in pairs]
    assert 0.0 in want and 1.0 in want
    # On the scorer's host threads, where math-verify's own signal timeouts cannot run.
    got = _score("math_verify", [p for _, p in pairs], [g for g, _ in pairs])
    assert got.tolist() == want


def test_math_verify_missing_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` fails
    with pytest.raises(ValueError) as e:
        parse_rewards("exact_match,math_verify")
    assert str(e.value) == ("task.rewards: math_verify needs Hugging Face's math-verify "
                            "package: pip install 'jaxrl-lp[math]'")


def test_parse_rewards_names_weights_and_errors():
    got = parse_rewards(" number_match = 2 , think_format=-0.5,exact_match")
    assert [(r.name, r.weight) for r in got] == [("number_match", 2.0), ("think_format", -0.5),
                                                 ("exact_match", 1.0)]
    assert all(callable(r.fn) for r in got) and set(BUILTIN_REWARDS) == {
        "exact_match", "number_match", "math_verify", "think_format", "regex_format"}
    assert [r.name for r in parse_rewards("")] == ["exact_match"]
    bad = {"exact_match,,think_format": "task.rewards: empty entry in ",
           "exact_match=high": "task.rewards: 'exact_match=high': the weight 'high' is not a finite",
           "exact_match=nan": "task.rewards: 'exact_match=nan': the weight 'nan' is not a finite",
           "exactmatch": "task.rewards: unknown reward 'exactmatch': not a built-in (exact_match,",
           "mymod.fn": "task.rewards: unknown reward 'mymod.fn': not a built-in (exact_match, "
                       "number_match, math_verify, think_format, regex_format) nor an import path "
                       "(mymod:reward_fn or path/to/file.py:reward_fn)",
           "exact_match,exact_match=2": "task.rewards: two reward functions are named 'exact_match'",
           "os:sep": "task.rewards: 'os:sep' is a str, not a function"}
    for spec, start in bad.items():
        with pytest.raises(ValueError) as e:
            parse_rewards(spec)
        assert str(e.value).startswith(start) and "\n" not in str(e.value), (spec, str(e.value))


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A user's directory on sys.path (as PYTHONPATH puts it), with modules of unique names
    (forgotten again after the test)."""
    before = set(sys.modules)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


_USER_MODULE = """
    import re

    def answer_reward(prompts, completions, answer, **kwargs):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    class Scorer:
        def length(completions, **kwargs):
            return [float(len(c)) for c in completions]
"""


def test_a_users_module_loads_by_module_and_by_file_path(user_dir, monkeypatch):
    _write(user_dir / "trl_user_mod.py", _USER_MODULE)
    sub = user_dir / "sub"
    sub.mkdir()
    _write(sub / "rewards_file.py", _USER_MODULE.replace("answer_reward", "file_reward"))
    monkeypatch.chdir(user_dir)
    fns = parse_rewards("trl_user_mod:answer_reward=0.5,sub/rewards_file.py:file_reward,"
                        "trl_user_mod:Scorer.length")
    assert [(r.name, r.weight) for r in fns] == [("answer_reward", 0.5), ("file_reward", 1.0),
                                                 ("length", 1.0)]
    b = RewardScorer(fns).score(**_batch(["4", "5"], answer=["4", "4"]), strict=True)
    np.testing.assert_array_equal(b.total_B, np.float32([2.5, 1.0]))
    assert set(b.metrics()) >= {"reward/answer_reward", "reward/file_reward", "reward/length"}
    # The same file twice is one module.
    assert load_object(str(sub / "rewards_file.py") + ":file_reward", "k") is fns[1].fn


def test_load_object_errors_are_one_line(user_dir):
    _write(user_dir / "trl_raises_mod.py", "raise RuntimeError('no GPU\\nfound')\n")
    _write(user_dir / "trl_dep_mod.py", "import trl_not_installed_dep\n")
    _write(user_dir / "trl_ok_mod.py", "def fn(completions, **kwargs):\n    return []\n")
    _write(user_dir / "bad_file.py", "raise ValueError('bad file')\n")
    with pytest.raises(ValueError) as e:
        load_object("trl_ok_mod.fn", "task.env")
    assert str(e.value) == ("task.env: 'trl_ok_mod.fn' is not an import path; write "
                            "module:attribute (mymod:reward_fn) or path/to/file.py:attribute")
    cases = {
        "trl_nowhere_mod:fn": "task.rewards: 'trl_nowhere_mod:fn': no module named "
                              "'trl_nowhere_mod' on sys.path; add its directory to PYTHONPATH, "
                              "or give a file (path/to/file.py:attr)",
        "trl_dep_mod:fn": "task.rewards: importing 'trl_dep_mod' (from 'trl_dep_mod:fn') raised "
                          "ModuleNotFoundError: No module named 'trl_not_installed_dep'; install "
                          "it or fix the import",
        "trl_ok_mod:gn": "task.rewards: 'trl_ok_mod:gn': trl_ok_mod has no attribute 'gn' (it "
                         "defines fn)",
        "trl_raises_mod:fn": "task.rewards: importing 'trl_raises_mod' (from "
                             "'trl_raises_mod:fn') raised RuntimeError: no GPU found",
        f"{user_dir}/bad_file.py:fn": f"task.rewards: importing {user_dir}/bad_file.py (from "
                                      f"'{user_dir}/bad_file.py:fn') raised ValueError: bad file",
        f"{user_dir}/absent.py:fn": f"task.rewards: '{user_dir}/absent.py:fn': no file "
                                    f"{user_dir}/absent.py; give an existing .py file or a module "
                                    "on sys.path (pkg.mod:attr)",
    }
    for spec, message in cases.items():
        with pytest.raises(ValueError) as e:
            parse_rewards(spec)
        assert str(e.value) == message, spec
    # A failed file import leaves nothing half-imported behind: the next try raises again.
    with pytest.raises(ValueError, match="bad file"):
        load_object(f"{user_dir}/bad_file.py:fn", "task.env")


def test_a_batch_is_a_named_tuple_of_its_parts():
    b = RewardBatch(np.zeros(2, np.float32), {"f": np.float32([np.nan, np.nan])}, {"f": 0}, 0.0)
    assert b.metrics() == {"reward/f": 0.0, "reward_failed/f": 0.0}
