"""Environments (`jaxrl_lp.envs`): the runner's failures, the calculator, its task's data."""

import os
import string
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from jaxrl_lp.envs import (
    CalculatorTask,
    EnvRunner,
    PythonCalculatorTask,
    StepResult,
    Turn,
    evaluate_expression,
    safe_eval,
)
from jaxrl_lp.models.tokenizer import CharTokenizer


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


def test_a_hung_call_does_not_hold_the_only_worker():
    """With `max_workers=1`, a call that hangs is left behind at its timeout and no longer
    counts: the environments after it are answered within the hung call's timeout and their
    own time, and so is the next round, while the hung call still runs."""
    release, ran = threading.Event(), []

    class Hangs(Echo):
        def step(self, turn):
            release.wait(10.0)  # hangs until the test ends (at most 10 s)
            ran.append("hung")
            return super().step(turn)

    runner = EnvRunner(timeout_s=0.3, max_workers=1, failure_reward=-1.0)
    try:
        t0 = time.perf_counter()
        out = runner.step([Hangs(), Echo(), Echo(), Echo()], [_turn(c) for c in "abcd"])
        took = time.perf_counter() - t0
        nxt = runner.step([Echo()], [_turn("e")])
        took_next = time.perf_counter() - t0 - took
        still_hung = not ran
    finally:
        release.set()
    assert took < 0.3 + 1.0, took  # the timeout, then three quick calls; not the hang's 10 s
    assert out[0].info["failed"] == "timeout" and out[0].reward == -1.0
    assert [r.observation for r in out[1:]] == list("BCD")
    assert nxt[0].observation == "E" and took_next < 1.0, took_next
    assert still_hung  # all of it was answered while the hung call still ran
    assert runner.failures == {"timeout": 1}


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


def test_a_malformed_step_result_is_that_episodes_failure():
    class Malformed(Echo):
        def step(self, turn):
            return StepResult(reward=float("nan") if turn.text == "n" else None)

    runner = EnvRunner(timeout_s=5.0)
    out = runner.step([Malformed(), Malformed(), Echo()], [_turn("n"), _turn("x"), _turn("c")])
    assert out[0].info["failed"] == "error: ValueError: StepResult.reward=nan: a finite number"
    assert out[1].info["failed"].startswith("error: ValueError: StepResult.reward=None")
    assert out[2].observation == "C" and runner.failures == {"error": 2}


@pytest.mark.parametrize("kwargs,field", [
    (dict(observation=None), "observation"), (dict(reward="1"), "reward"),
    (dict(reward=True), "reward"), (dict(reward=float("inf")), "reward"),
    (dict(done=1), "done"), (dict(info=[("tool_call", True)]), "info")])
def test_a_step_result_names_a_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=f"StepResult.{field}="):
        StepResult(**kwargs)


def test_results_and_turns_normalize_numpy_values():
    r = StepResult(reward=np.float32(0.5), done=np.bool_(True))
    assert type(r.reward) is float and r.reward == 0.5 and r.done is True
    t = Turn(tokens=np.array([3, 4]), text="01", ended_by="stop")
    assert t.tokens == (3, 4) and all(type(x) is int for x in t.tokens)
    with pytest.raises(ValueError, match="ended_by='max'"):
        Turn(tokens=(3,), text="0", ended_by="max")


@pytest.mark.parametrize("kwargs,words", [
    (dict(timeout_s=0), ["timeout_s", "> 0"]),
    (dict(failure_reward=float("nan")), ["failure_reward", "finite"]),
    (dict(timeout_s="1"), ["timeout_s", "> 0"]),
    (dict(max_workers=0), ["max_workers", ">= 1"]), (dict(max_workers=2.0), ["max_workers", "int"])])
def test_the_runner_names_a_bad_setting(kwargs, words):
    with pytest.raises(ValueError) as e:
        EnvRunner(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("text,value", [
    ("347*29", 10063), ("2+3*4", 14), ("10-25", -15), ("7", 7), ("007*2", 14),
    ("", None), ("3/4", None), ("2**10", None), ("__import__", None), ("1+", None),
    ("1" * 25, None), ("(1+2)", None), ("1 + 2", None), ("-3", None), ("1e5", None)])
def test_the_calculator_reads_digits_and_plus_minus_times_only(text, value):
    assert evaluate_expression(text) == value


def test_a_calculator_value_is_never_longer_than_its_expression():
    # What `CalculatorTask.max_observation_tokens` rests on.
    rng = np.random.default_rng(0)
    for _ in range(3000):
        n = int(rng.integers(1, 6))
        parts = [str(int(rng.integers(0, 10 ** int(rng.integers(1, 5))))).zfill(
            int(rng.integers(1, 4))) for _ in range(n)]
        text = parts[0] + "".join(str(rng.choice(list("+-*"))) + p for p in parts[1:])
        value = evaluate_expression(text)
        assert value is not None and len(str(value)) <= len(text), text


def _play(task, record):
    """Plays `task.sft_example(record)` through a fresh environment as the sampler would:
    a model turn runs to a stop token or EOS, the observation must be exactly the masked
    tokens that follow. Returns (the episode's summed reward, its turns, its infos)."""
    tok = task.tokenizer
    prompt, completion, mask = task.sft_example(record)
    env = task.make_env()
    assert env.reset(record) == prompt and prompt[0] == tok.bos_id
    stops, total, infos, i = set(task.stop_token_ids), 0.0, [], 0
    while True:
        j = i
        while completion[j] != tok.eos_id and completion[j] not in stops:
            j += 1
        eos = completion[j] == tok.eos_id
        assert mask[i:j + 1] == [1.0] * (j + 1 - i), "a model turn is not all in the loss"
        assert j + 1 - i <= task.max_turn_tokens, "a warm-start turn is over the turn limit"
        tokens = completion[i:j] if eos else completion[i:j + 1]
        result = env.step(Turn(tuple(tokens), tok.decode(tokens), "eos" if eos else "stop"))
        total += result.reward
        infos.append(dict(result.info))
        if result.done:
            assert j == len(completion) - 1, "the episode ended before its script did"
            return total, len(infos), infos
        assert not eos, "an EOS turn did not end the episode"
        observation = tok.encode(result.observation)
        assert len(observation) <= task.max_observation_tokens
        k = j + 1 + len(observation)
        assert completion[j + 1:k] == observation, (tok.decode(completion[j + 1:k]),
                                                   result.observation)
        assert mask[j + 1:k] == [0.0] * len(observation) and mask[k] == 1.0
        i = k


def _tok_turn(tok, text, ended_by="stop"):
    return Turn(tuple(tok.encode(text)), text, ended_by)


def test_a_calculator_episode_scripted_through_a_call_and_an_answer():
    task = CalculatorTask(seed=1)
    problem = task.train[3]
    tok = task.tokenizer
    env = task.make_env()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step(_tok_turn(tok, "1?"))
    assert env.reset(problem) == tok.encode(problem.prompt, add_bos=True)
    call = env.step(_tok_turn(tok, f"{problem.a}*{problem.b}?"))
    assert call == StepResult(observation=f"{problem.a * problem.b};",
                              info={"tool_call": True, "tool_calls": 1, "tool_ok": True})
    bad = env.step(_tok_turn(tok, "12x?"))
    assert bad == StepResult(observation="err;",
                             info={"tool_call": True, "tool_calls": 2, "tool_ok": False})
    right = env.step(_tok_turn(tok, problem.answer, "eos"))
    assert right == StepResult(reward=1.0, done=True,
                               info={"tool_call": False, "tool_calls": 2})
    assert task.solved(problem, right.reward)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step(_tok_turn(tok, "1?"))
    env.reset(problem)  # a reset starts the count again
    wrong = env.step(_tok_turn(tok, str(int(problem.answer) + 1), "eos"))
    assert wrong.done and wrong.reward == 0.0 and wrong.info["tool_calls"] == 0
    assert not task.solved(problem, wrong.reward)
    env.reset(problem)
    cut = env.step(_tok_turn(tok, "1234567", "length"))
    assert cut.done and cut.reward == 0.0 and cut.info["truncated"]
    # A special token inside the answer breaks the exact match (its text skips it).
    env.reset(problem)
    ids = tok.encode(problem.answer)
    stray = Turn((*ids[:1], tok.pad_id, *ids[1:]), problem.answer, "eos")
    assert env.step(stray).reward == 0.0


def test_a_calculator_episode_out_of_turns_ends_in_the_sampler_not_the_env():
    # The env never counts turns: `TurnLimits.max_turns` ends the episode (reason
    # `max_turns`), so calls up to the limit are all answered.
    task = CalculatorTask(max_turns=2)
    env, tok = task.make_env(), task.tokenizer
    env.reset(task.train[0])
    for n in range(1, 4):
        result = env.step(_tok_turn(tok, "2*3?"))
        assert not result.done and result.observation == "6;" and result.info["tool_calls"] == n


@pytest.mark.parametrize("ops,digits", [("*", (3, 2)), ("-", (3, 1)), ("-", (1, 3)),
                                        ("+-*", (2, 2))])
def test_calculator_warm_start_episodes_play_through_the_env(ops, digits):
    for tool_fraction in (0.0, 1.0):
        task = CalculatorTask(ops=ops, digits=digits, tool_fraction=tool_fraction)
        for i in range(40):
            p = task.train[i]
            total, turns, infos = _play(task, p)
            assert total == 1.0 and task.solved(p, total)
            assert turns == (2 if tool_fraction else 1) <= task.max_turns
            assert [x["tool_call"] for x in infos] == [True, False][-turns:]
            prompt, completion, _ = task.sft_example(p)
            assert len(prompt) + len(completion) <= task.max_sequence_length
            assert len(completion) <= task.max_completion_tokens


def test_the_calculator_task_splits_and_its_warm_start_episodes():
    task = CalculatorTask(seed=0)
    train = {task.train[i].prompt for i in range(500)}
    held = {task.heldout[i].prompt for i in range(200)}
    assert not train & held
    assert [task.train[i] for i in range(5)] == [CalculatorTask(seed=0).train[i] for i in range(5)]
    assert [task.heldout[i] for i in range(5)] == [CalculatorTask(seed=0).heldout[i]
                                                   for i in range(5)]
    assert [task.train[i] for i in range(5)] != [CalculatorTask(seed=1).train[i] for i in range(5)]
    assert task.train[-1] == task.train[len(task.train) - 1] and task.train[2:4] == [
        task.train[2], task.train[3]]
    for i in range(50):
        p = task.train[i]
        assert 100 <= p.a <= 999 and 10 <= p.b <= 99 and p.op == "*"
        prompt, completion, mask = task.sft_example(p)
        text = task.tokenizer.decode(completion)
        assert completion[-1] == task.tokenizer.eos_id
        if task.uses_tool(p):
            call, observation = f"{p.a}*{p.b}?", f"{p.answer};"
            assert text == call + observation + p.answer
            assert mask == [1.0] * len(call) + [0.0] * len(observation) + [1.0] * (
                len(p.answer) + 1)
        else:
            assert text == p.answer and mask == [1.0] * len(completion)
    share = np.mean([task.uses_tool(task.train[i]) for i in range(4000)])
    assert abs(share - 0.3) < 0.03, share  # tool_fraction, within ~4 standard errors
    assert CalculatorTask(tool_fraction=0.0).uses_tool(task.train[0]) is False
    assert CalculatorTask(tool_fraction=1.0).uses_tool(task.train[0]) is True


@pytest.mark.parametrize("kwargs,words", [
    (dict(digits=(3, 0)), ["digits", "[1, 9]"]), (dict(ops="/"), ["ops", "+-*"]),
    (dict(tool_fraction=1.5), ["tool_fraction", "[0, 1]"]),
    (dict(heldout_fraction=0.0), ["heldout_fraction", "(0, 1)"]),
    (dict(max_turns=0), ["max_turns", ">= 1"]), (dict(size=0), ["size", ">= 1"]),
    (dict(max_turn_tokens=6), ["max_turn_tokens", ">= 7"]),
    (dict(tokenizer=CharTokenizer("0123456789+-*=")), ["tokenizer", "?;"])])
def test_the_calculator_task_names_a_bad_setting(kwargs, words):
    with pytest.raises(ValueError) as e:
        CalculatorTask(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_the_calculator_limits_follow_max_turn_tokens():
    default = CalculatorTask()
    assert (default.max_turn_tokens, default.max_observation_tokens) == (7, 7)
    assert default.stop_token_ids == tuple(default.tokenizer.encode("?"))
    wide = CalculatorTask(max_turn_tokens=40)
    # A call reads at most MAX_EXPRESSION characters, whatever the turn limit.
    assert (wide.max_turn_tokens, wide.max_observation_tokens) == (40, 25)
    assert wide.max_sequence_length == default.max_sequence_length  # the warm-start's own
    env = wide.make_env()
    env.reset(wide.train[0])
    longest = "9" * 12 + "*" + "9" * 11
    out = env.step(_tok_turn(wide.tokenizer, longest + "?"))
    assert out.info["tool_ok"] and len(out.observation) <= wide.max_observation_tokens


# ---------------------------------------------------------------- GSM8K with a calculator
@pytest.mark.parametrize("text,value", [
    ("48/2", 24.0), ("2**10", 1024), ("(3+4)*5", 35), ("-7 % 3", 2), ("1,000*2", 2000),
    ("7//2", 3), ("0.5*3", 1.5), ("2**-1", 0.5), ("-(2+3)", -5), ("+4", 4), (".5*4", 2.0),
    ("10**5*10**10", 10**15)])
def test_safe_eval_computes_arithmetic(text, value):
    out = safe_eval(text)
    assert out == value and type(out) is type(value)


@pytest.mark.parametrize("text", [
    "__import__('os')", "x+1", "len([1])", "(1).real", "2**100", "2**11", "1/0", "1%0",
    "10**10*10**10", "10**16", "[1]", "1 if 1 else 2", "'a'*3", "1e400", "(-8)**0.5",
    "lambda: 1", "[x for x in (1,)]", "1 < 2", "not 1", "~1", "True+1", "1j", "2 ** 3 ** 3",
    "9" * 201, "1+"])
def test_safe_eval_refuses_everything_else(text):
    with pytest.raises(ValueError):
        safe_eval(text)


def _records():
    records = [{"question": f"What is twice {a} + {b}?",
                "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b} and {a + b} > {a}, so "
                          f"{a + b}*2 = <<{a + b}*2={2 * (a + b)}>>{2 * (a + b)}. "
                          f"#### {2 * (a + b)}"}
               for a in range(1, 6) for b in range(1, 6)]
    records.append({"question": "What is a third of 10, to two places?",
                    "answer": "10/3 = <<10/3=3.33>>3.33 #### 3.33"})
    records.append({"question": "What is x times 2 when x is 2?",
                    "answer": "x*2 = <<x*2=4>>4 #### 4"})
    return records


def _gsm8k_task(tok=None, **kwargs):
    from jaxrl_lp.data.gsm8k import GSM8KTask

    tok = tok or CharTokenizer(alphabet=string.ascii_letters + string.digits
                               + " #.,?:\n+-=<>/*")
    return PythonCalculatorTask(GSM8KTask(_records(), tok, heldout_fraction=0.3), max_turns=6,
                                max_turn_tokens=48, **kwargs)


def test_a_gsm8k_episode_calls_the_calculator_and_is_rewarded_on_its_answer():
    task = _gsm8k_task()
    tok = task.tokenizer
    assert task.stop_token_ids == (tok.encode(">")[0],)  # one character ends with '>'
    record = {"question": "What is 3 + 4?", "answer": "3 + 4 = <<3+4=7>>7 #### 7"}
    env = task.make_env()
    assert env.reset(record) == task.prompt_ids(record)
    # The call as the sampler cuts it: a stop on "<calc>", then one on "</calc>".
    opened = env.step(_tok_turn(tok, " 3 + 4 = <calc>"))
    assert opened == StepResult(info={"tool_call": False, "tool_calls": 0})
    call = env.step(_tok_turn(tok, "3+4</calc>"))
    assert call == StepResult(observation="<result>7</result>",
                              info={"tool_call": True, "tool_calls": 1, "tool_ok": True})
    other = env.step(_tok_turn(tok, " 7 > 2"))  # a '>' that closes no call: no observation
    assert other == StepResult(info={"tool_call": False, "tool_calls": 1})
    stale = env.step(_tok_turn(tok, " and </calc>"))  # no <calc> since the last result
    assert stale.observation == "" and not stale.info["tool_call"]
    bad = env.step(_turn("<calc>__import__('os')</calc>"))
    assert bad.observation == "<result>error</result>" and bad.info["tool_ok"] is False
    assert "Call" in bad.info["tool_error"] and bad.info["tool_calls"] == 2
    huge = env.step(_tok_turn(tok, "<calc>10**5*10**10*10</calc>"))
    assert huge.observation == "<result>error</result>" and "range" in huge.info["tool_error"]
    done = env.step(_tok_turn(tok, " #### 7", "eos"))
    assert done.done and done.reward == 1.0 and task.solved(record, done.reward)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step(_tok_turn(tok, "#### 7", "eos"))
    env.reset(record)
    wrong = env.step(_tok_turn(tok, "#### 999", "eos"))
    assert wrong.reward == 0.0 and not task.solved(record, wrong.reward)
    env.reset(record)
    cut = env.step(_tok_turn(tok, "#### 7", "length"))  # cut: no reward, even if right
    assert cut.done and cut.reward == 0.0 and cut.info["truncated"]
    with pytest.raises(RuntimeError, match="before reset"):
        task.make_env().step(_tok_turn(tok, "1"))


def test_a_gsm8k_result_longer_than_the_observation_limit_is_an_error():
    task = _gsm8k_task()
    error_tokens = len(task.tokenizer.encode("<result>error</result>"))
    # The default fits the longest result of the warm-start's episodes (10/3's).
    assert task.max_observation_tokens == len("<result>3.333333333</result>")
    assert task.answer("-(10**5*10**4)")[0] == "<result>-1000000000</result>"
    out, facts = task.answer("-(10**5*10**10)")
    assert out == "<result>error</result>" and facts == {
        "tool_ok": False, "tool_error": "result longer than max_observation_tokens=28"}
    roomy = _gsm8k_task(max_observation_tokens=40)
    assert roomy.answer("-(10**5*10**10)")[0] == "<result>-1000000000000000</result>"
    assert roomy.answer("-1.234567891*10**-10")[0] == "<result>-1.234567891e-10</result>"
    tight = _gsm8k_task(max_observation_tokens=error_tokens)
    env = tight.make_env()
    env.reset(tight.train[0])
    out = env.step(_tok_turn(tight.tokenizer, "<calc>10**5*10**9</calc>"))
    assert out.observation == "<result>error</result>" and "max_observation_tokens=" in \
        out.info["tool_error"]
    assert env.step(_tok_turn(tight.tokenizer, "<calc>10*2</calc>")).observation == \
        "<result>20</result>"
    with pytest.raises(ValueError, match=f"max_observation_tokens=5 must be an int >= "
                                         f"{error_tokens}"):
        _gsm8k_task(max_observation_tokens=5)
    with pytest.raises(ValueError, match="max_turns=0 must be an int >= 1"):
        PythonCalculatorTask(tight.base, max_turns=0)
    with pytest.raises(ValueError, match="base=list must be a GSM8KTask"):
        PythonCalculatorTask(_records())


def test_gsm8k_warm_start_episodes_turn_annotations_into_calls():
    task = _gsm8k_task()
    tok = task.tokenizer
    for record in task.train[:5]:
        prompt, completion, mask = task.sft_example(record)
        text = tok.decode(completion)
        calls = [c.split("=") for c in record["answer"].split("<<")[1:]]
        calls = [(c[0], c[1].split(">>")[0]) for c in calls]
        expected = "".join(f"<result>{v}</result>" for _, v in calls)
        for e, v in calls:
            assert f"<calc>{e}</calc><result>{v}</result>{v}" in text
        assert "<<" not in text and text.endswith(record["answer"][-8:])
        masked = tok.decode([t for t, m in zip(completion, mask, strict=True) if m == 0.0])
        assert masked == expected  # exactly the observations are out of the loss
        assert completion[-1] == tok.eos_id and mask[-1] == 1.0
        assert len(prompt) + len(completion) <= task.max_sequence_length
    # The observation is the environment's answer, not the annotation's rounding.
    third = {"question": "q", "answer": "10/3 = <<10/3=3.33>>3.33 #### 3.33"}
    assert "<calc>10/3</calc><result>3.333333333</result>3.33" in tok.decode(
        task.sft_example(third)[1])
    # An annotation the calculator cannot read is dropped, its text kept.
    unread = {"question": "q", "answer": "x*2 = <<x*2=4>>4 #### 4"}
    _, completion, mask = task.sft_example(unread)
    assert tok.decode(completion) == " x*2 = 4 #### 4" and mask == [1.0] * len(completion)


def test_gsm8k_warm_start_episodes_play_through_the_env():
    task = _gsm8k_task()
    most = 0
    for record in [*task.train, *task.heldout]:
        total, turns, infos = _play(task, record)
        assert total == 1.0 and task.solved(record, total)
        assert sum(i["tool_call"] for i in infos) == record["answer"].count("<<") - (
            "x*2" in record["answer"])
        most = max(most, turns)
    # Two annotations: stops on "<calc>", "</calc>", the text's ">", then the answer.
    assert most == task.warm_start_turns == 6 <= task.max_turns


def _bpe_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from jaxrl_lp.models.tokenizer import HFTokenizer

    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [r["question"] + r["answer"] for r in _records()]
    texts += [f"<calc>{a}*{b}</calc><result>{a * b}</result>" for a in range(30) for b in range(9)]
    bpe.train_from_iterator(texts * 4, trainer)
    ids = {t: bpe.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>")}
    return HFTokenizer(bpe, bos_id=ids["<bos>"], eos_id=ids["<eos>"], pad_id=ids["<pad>"])


def test_gsm8k_episodes_with_a_bpe_tokenizer_play_through_the_env():
    tok = _bpe_tokenizer()
    task = _gsm8k_task(tok)
    stops = task.stop_token_ids
    texts = [tok.decode([i]) for i in stops]
    assert all(t.endswith(">") for t in texts) and len(stops) > 1, texts  # merges too
    assert tok.eos_id not in stops and tok.bos_id not in stops
    assert all(not tok.decode([i]).endswith(">") for i in range(tok.vocab_size)
               if i not in stops)
    for record in [*task.train, *task.heldout]:
        total, turns, _ = _play(task, record)
        assert total == 1.0 and turns <= task.warm_start_turns
    assert task.max_observation_tokens == max(
        len(tok.encode(f"<result>{v}</result>")) for v in ["error", "3.333333333", "20"])
