"""Environments (`jaxrl_lp.envs`): the runner's failures, the calculator, its task's data."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from jaxrl_lp.data.pipeline import sft_batch
from jaxrl_lp.envs import (
    CalculatorTask,
    EnvRunner,
    PythonCalculatorTask,
    StepResult,
    Turn,
    evaluate_expression,
    safe_eval,
)


class Echo:
    def __init__(self, behaviour="ok", delay=0.0):
        self.behaviour, self.delay = behaviour, delay

    def reset(self, record):
        return [1]

    def step(self, turn):
        time.sleep(self.delay)
        if self.behaviour == "raise":
            raise KeyError("boom")
        if self.behaviour == "garbage":
            return "not a result"
        return StepResult(observation=turn.text.upper(), reward=1.0)


def _turn(text, ended_by="stop"):
    return Turn(tokens=tuple(range(len(text))), text=text, ended_by=ended_by)


def test_the_runner_records_failures_and_steps_the_others_in_order():
    runner = EnvRunner(timeout_s=0.5, max_workers=4, failure_reward=-1.0)
    envs = [Echo(), Echo("raise"), Echo("ok", delay=5.0), Echo("garbage"), Echo(), Echo()]
    turns = [_turn("a"), _turn("b"), _turn("c"), _turn("d"), None, _turn("f")]
    t0 = time.perf_counter()
    out = runner.step(envs, turns)
    took = time.perf_counter() - t0
    assert took < 2.0, took  # the hung call is left behind after its timeout
    assert out[0] == StepResult(observation="A", reward=1.0)
    assert out[1].done and out[1].reward == -1.0
    assert out[1].info["failed"] == "error: KeyError: 'boom'"
    assert out[2].done and out[2].info["failed"] == "timeout" and out[2].reward == -1.0
    assert out[3].done and out[3].info["failed"].startswith("error: step returned str")
    assert out[4] is None  # not stepped
    assert out[5].observation == "F"
    assert runner.calls == 5 and runner.failures == {"error": 2, "timeout": 1}
    assert runner.seconds >= 0.5
    # The runner goes on after a hang.
    assert runner.step([Echo()], [_turn("g")])[0].observation == "G"


def test_an_env_that_exits_is_an_error_at_once_not_a_timeout():
    class Exits(Echo):
        def step(self, turn):
            sys.exit(3)

    runner = EnvRunner(timeout_s=5.0)
    t0 = time.perf_counter()
    out = runner.step([Exits(), Echo()], [_turn("a"), _turn("b")])
    assert time.perf_counter() - t0 < 2.0  # not left to run out its 5 s
    assert out[0].info["failed"] == "error: SystemExit: 3" and out[0].done
    assert out[1].observation == "B" and runner.failures == {"error": 1}


def test_the_runner_runs_at_most_max_workers_calls_at_once():
    lock, running, peak = threading.Lock(), [0], [0]

    class Counted(Echo):
        def step(self, turn):
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            time.sleep(0.05)
            with lock:
                running[0] -= 1
            return super().step(turn)

    out = EnvRunner(timeout_s=5.0, max_workers=2).step(
        [Counted() for _ in range(6)], [_turn(c) for c in "abcdef"])
    assert [r.observation for r in out] == list("ABCDEF")
    assert peak[0] == 2, peak[0]


def test_a_hung_env_does_not_block_the_interpreter_from_exiting():
    script = textwrap.dedent("""
        import time
        from jaxrl_lp.envs import EnvRunner, StepResult, Turn

        class Hangs:
            def step(self, turn):
                time.sleep(60)

        out = EnvRunner(timeout_s=0.2).step([Hangs()], [Turn((5,), "2", "stop")])
        print(out[0].info["failed"])
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "timeout"
    assert time.perf_counter() - t0 < 20  # far below the hung call's 60 s


@pytest.mark.parametrize("kwargs,words", [
    (dict(timeout_s=0), ["timeout_s", "> 0"]), (dict(timeout_s="1"), ["timeout_s", "> 0"]),
    (dict(max_workers=0), ["max_workers", ">= 1"]), (dict(max_workers=2.0), ["max_workers", "int"])])
def test_the_runner_names_a_bad_setting(kwargs, words):
    with pytest.raises(ValueError) as e:
        EnvRunner(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("text,value", [
    ("347*29", 10063), ("2+3*4", 14), ("10-25", -15), ("7", 7),
    ("", None), ("3/4", None), ("2**10", None), ("__import__", None), ("1+", None),
    ("1" * 25, None), ("(1+2)", None), ("1 + 2", None)])
def test_the_calculator_reads_digits_and_plus_minus_times_only(text, value):
    assert evaluate_expression(text) == value


def test_a_calculator_episode_scripted_through_a_call_and_an_answer():
    task = CalculatorTask(seed=1)
    problem = task.train[3]
    env = task.make_env()
    tok = task.tokenizer
    assert env.reset(problem) == tok.encode(problem.prompt, add_bos=True)
    call = env.step(_turn(f"{problem.a}*{problem.b}?"))
    assert call == StepResult(observation=f"{problem.a * problem.b};",
                              info={"tool_call": True, "tool_ok": True})
    bad = env.step(_turn("12x?"))
    assert bad.observation == "err;" and not bad.done and bad.info["tool_ok"] is False
    right = env.step(_turn(problem.answer, "eos"))
    assert right.done and right.reward == 1.0
    wrong = env.step(_turn(str(int(problem.answer) + 1), "eos"))
    assert wrong.done and wrong.reward == 0.0
    cut = env.step(_turn("1234567", "length"))
    assert cut.done and cut.reward == 0.0 and cut.info["truncated"]
    with pytest.raises(RuntimeError, match="before reset"):
        task.make_env().step(_turn("1?"))


def test_the_calculator_task_splits_and_its_warm_start_episodes():
    task = CalculatorTask(seed=0)
    train = {task.train[i].prompt for i in range(500)}
    held = {task.heldout[i].prompt for i in range(200)}
    assert not train & held
    assert [task.train[i] for i in range(5)] == [CalculatorTask(seed=0).train[i] for i in range(5)]
    assert [task.train[i] for i in range(5)] != [CalculatorTask(seed=1).train[i] for i in range(5)]
    for i in range(50):
        p = task.train[i]
        assert 100 <= p.a <= 999 and 10 <= p.b <= 99 and p.op == "*"
        prompt, completion, mask = task.sft_example(p)
        text = task.tokenizer.decode(completion)
        if task.uses_tool(p):
            call, observation = f"{p.a}*{p.b}?", f"{p.answer};"
            assert text == call + observation + p.answer
            assert mask == [1.0] * len(call) + [0.0] * len(observation) + [1.0] * (
                len(p.answer) + 1)
        else:
            assert text == p.answer and mask == [1.0] * len(completion)
        assert len(prompt) + len(completion) <= task.max_sequence_length
    share = np.mean([task.uses_tool(task.train[i]) for i in range(4000)])
    assert abs(share - 0.3) < 0.03, share  # tool_fraction, within ~4 standard errors
    assert CalculatorTask(tool_fraction=0.0).uses_tool(task.train[0]) is False
    with pytest.raises(ValueError, match="digits"):
        CalculatorTask(digits=(3, 0))


def test_sft_batch_masks_an_examples_observation():
    b = sft_batch([([1, 5], [7, 8, 2], [1.0, 0.0, 1.0]), ([1], [3, 2])], pad_id=0, seq_len=6)
    assert b.loss_mask_BxL.tolist() == [[0, 0, 1, 0, 1, 0], [0, 1, 1, 0, 0, 0]]
    assert b.tokens_BxL.tolist() == [[1, 5, 7, 8, 2, 0], [1, 3, 2, 0, 0, 0]]
    with pytest.raises(ValueError, match="loss mask of 2"):
        sft_batch([([1], [7, 8, 2], [1.0, 0.0])], pad_id=0)


# ---------------------------------------------------------------- GSM8K with a calculator
@pytest.mark.parametrize("text,value", [
    ("48/2", 24.0), ("2**10", 1024), ("(3+4)*5", 35), ("-7 % 3", 2), ("1,000*2", 2000),
    ("7//2", 3), ("0.5*3", 1.5)])
def test_safe_eval_computes_arithmetic(text, value):
    assert safe_eval(text) == value


@pytest.mark.parametrize("text", [
    "__import__('os')", "x+1", "len([1])", "(1).real", "2**100", "1/0", "10**10*10**10",
    "[1]", "1 if 1 else 2", "'a'*3", "1e400"])
def test_safe_eval_refuses_everything_else(text):
    with pytest.raises(ValueError):
        safe_eval(text)


def _gsm8k_task():
    import string

    from jaxrl_lp.data.gsm8k import GSM8KTask
    from jaxrl_lp.models.tokenizer import CharTokenizer

    tok = CharTokenizer(alphabet=string.ascii_letters + string.digits + " #.,?:\n+-=<>/*")
    records = [{"question": f"What is {a} + {b}?",
                "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}. #### {a + b}"}
               for a in range(1, 5) for b in range(1, 5)]
    return PythonCalculatorTask(GSM8KTask(records, tok, heldout_fraction=0.5), max_turns=4,
                                max_turn_tokens=32)


def test_a_gsm8k_episode_calls_the_calculator_and_is_rewarded_on_its_answer():
    task = _gsm8k_task()
    tok = task.tokenizer
    assert task.stop_token_ids == (tok.encode(">")[0],)  # one character ends with '>'
    record = task.train[0]
    a, b = (int(x) for x in record["question"].removeprefix("What is ").rstrip("?").split(" + "))
    env = task.make_env()
    assert env.reset(record) == task.prompt_ids(record)
    call = env.step(_turn(f" {a} + {b} = <calc>{a}+{b}</calc>"))
    assert call.observation == f"<result>{a + b}</result>" and call.info["tool_ok"]
    other = env.step(_turn(" 3 > 2"))  # a '>' that closes no call: no observation
    assert other == StepResult(info={"tool_call": False})
    bad = env.step(_turn("<calc>__import__('os')</calc>"))
    assert bad.observation == "<result>error</result>" and bad.info["tool_ok"] is False
    done = env.step(_turn(f"{a + b}. #### {a + b}", "eos"))
    assert done.done and done.reward == 1.0
    wrong = task.make_env()
    wrong.reset(record)
    assert wrong.step(_turn("#### 999", "eos")).reward == 0.0


def test_gsm8k_warm_start_episodes_turn_annotations_into_calls():
    task = _gsm8k_task()
    record = task.train[0]
    prompt, completion, mask = task.sft_example(record)
    tok = task.tokenizer
    text = tok.decode(completion)
    a_b, value = record["answer"].split("<<")[1].split(">>")[0].split("=")
    assert f"<calc>{a_b}</calc><result>{value}</result>" in text and "<<" not in text
    masked = tok.decode([t for t, m in zip(completion, mask, strict=True) if m == 0.0])
    assert masked == f"<result>{value}</result>"
    assert completion[-1] == tok.eos_id and mask[-1] == 1.0
    assert len(prompt) + len(completion) <= task.max_sequence_length
