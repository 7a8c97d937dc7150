"""Reward functions with TRL's signature: parsed from a config string, run on host threads
with a timeout, combined with weights.

A reward function is what TRL's `GRPOTrainer` takes, so a TRL user's function runs
unchanged: it is called once per batch with keywords only,

    fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns)

where `columns` are the record's other fields (the reference answer as `answer`), each a
list of B values, and returns B values: a number, or None where it does not apply to that
sample. A function without `**kwargs` gets only the keywords it names. For a chat task
(prompts are message lists) each completion is `[{"role": "assistant", "content": text}]`,
as TRL passes it. An `async def` function is run to completion on its thread.

The total of a sample is TRL's: the weighted sum of its values with None left out (a sample
every function skips gets 0.0). `RewardBatch.parts` keeps each function's values (NaN for
None), logged as `reward/<name>`.

Failures are never a silent zero. A function that raises, does not return within the
timeout (its thread is left behind, never joined) or returns the wrong number of values
fails on the whole batch; a value that is not a finite number fails on its sample. At the
start probe (`strict=True`) the first failure is raised as one line naming the function,
what happened and the first failing record, before anything is written. During training
each failed sample scores the configured `failure_reward`, counted as
`reward_failed/<name>`, and one line per function and batch goes to stderr.

Built-ins (`BUILTIN_REWARDS`) read the reference answer (`answer`): `exact_match`,
`number_match` (GSM8K's numeric extraction, `data.rewards.extract_answer`), `math_verify`
(Hugging Face's math-verify, an extra), and the format checks `think_format` and
`regex_format`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import numbers
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxrl_lp.data.rewards import gsm8k_reward
from jaxrl_lp.tasks.imports import load_object

__all__ = ["BUILTIN_REWARDS", "RewardBatch", "RewardFunction", "RewardScorer", "parse_rewards"]


class RewardFunction(NamedTuple):
    """One reward function of a task.

    Attributes:
      name: the metric name (`reward/<name>`): the function's `__name__` or a built-in's name.
      fn: the function, TRL's signature: `fn(prompts, completions, completion_ids=...,
        **columns) -> list[float | None]`.
      weight: its factor in the total.
    """

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0


def _text(completion: Any) -> str:
    """A completion's text: a string, or a chat completion's last message's content."""
    if completion is None:
        return ""
    if isinstance(completion, list):
        return str(completion[-1]["content"]) if completion else ""
    return str(completion)


def _answers(name: str, answer: Sequence[Any] | None) -> Sequence[Any]:
    if answer is None:
        raise ValueError(f"{name} needs the reference answers (the `answer` keyword: set "
                         "task.answer_key to the column that holds them)")
    return answer


def _exact_match() -> Callable[..., list[float | None]]:
    def exact_match(completions, answer=None, **kwargs):
        return [None if a is None else float(_text(c).strip() == str(a).strip())
                for c, a in zip(completions, _answers("exact_match", answer), strict=True)]
    return exact_match


def _number_match() -> Callable[..., list[float | None]]:
    def number_match(completions, answer=None, **kwargs):
        # gsm8k_reward: the number after '####', else the last number, compared as a Decimal.
        return [None if a is None else gsm8k_reward(_text(c), str(a))
                for c, a in zip(completions, _answers("number_match", answer), strict=True)]
    return number_match


class _NoTimeoutWarning(logging.Filter):
    """math-verify warns once that its timeout is off: the scorer applies the timeout."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def _math_verify() -> Callable[..., list[float | None]]:
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ValueError("math_verify needs Hugging Face's math-verify package: "
                         "pip install 'jaxrl-lp[math]'") from None
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTimeoutWarning) for f in logger.filters):
            logger.addFilter(_NoTimeoutWarning())

    def math_verify(completions, answer=None, **kwargs):
        # Its own timeouts are signal alarms, which fail off the main thread: off here.
        out: list[float | None] = []
        for c, a in zip(completions, _answers("math_verify", answer), strict=True):
            if a is None:
                out.append(None)
                continue
            gold = parse(str(a), parsing_timeout=None)
            out.append(float(verify(gold, parse(_text(c), parsing_timeout=None),
                                    timeout_seconds=None)))
        return out
    return math_verify


def _think_format() -> Callable[..., list[float]]:
    pattern = re.compile(r"\s*<think>(.*?)</think>(.*)", re.DOTALL)

    def think_format(completions, **kwargs):
        out = []
        for c in completions:
            m = pattern.fullmatch(_text(c))
            ok = (m is not None and "<think>" not in m.group(1) and "think>" not in m.group(2)
                  and m.group(2).strip() != "")
            out.append(float(ok))
        return out
    return think_format


def _regex_format(format_regex: str) -> Callable[..., list[float]]:
    if not format_regex:
        raise ValueError("regex_format needs a pattern: set task.format_regex")
    try:
        pattern = re.compile(format_regex, re.DOTALL)
    except re.error as e:
        raise ValueError(f"regex_format: task.format_regex={format_regex!r} is not a valid "
                         f"regular expression ({e})") from None

    def regex_format(completions, **kwargs):
        return [float(pattern.fullmatch(_text(c)) is not None) for c in completions]
    return regex_format


BUILTIN_REWARDS: dict[str, Callable[..., Callable[..., list[float | None]]]] = {
    "exact_match": _exact_match,    # the completion's text stripped == the answer stripped
    "number_match": _number_match,  # GSM8K's numeric extraction of both, equal as numbers
    "math_verify": _math_verify,    # math-verify: verify(parse(answer), parse(completion))
    "think_format": _think_format,  # '<think>...</think>' then a non-empty answer
    "regex_format": _regex_format,  # re.fullmatch(format_regex, completion, DOTALL)
}
"""The built-in reward functions by name: each value is a factory (`regex_format` takes the
pattern, the others nothing) returning a TRL-signature function that scores 1.0 or 0.0 (None
where a record has no answer)."""


def _name_of(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def parse_rewards(spec: str, key: str = "task.rewards", *,
                  format_regex: str = "") -> tuple[RewardFunction, ...]:
    """The reward functions a config string names.

    Args:
      spec: comma-separated entries `NAME_OR_PATH[=WEIGHT]`: a built-in name
        (`BUILTIN_REWARDS`) or an import path `pkg.mod:fn` / `path/to/file.py:fn`
        (`load_object`); the weight defaults to 1. '' is `exact_match`.
      key: the config key, named by every error.
      format_regex: the pattern of `regex_format`.

    Returns:
      The functions, in the order given.

    Raises:
      ValueError: one line naming `key`: an empty entry, a bad weight, an unknown name, a
        path that does not load or is not callable, a name given twice, a missing extra.

    Examples:
      >>> [(r.name, r.weight) for r in parse_rewards("number_match,think_format=0.2")]
      [('number_match', 1.0), ('think_format', 0.2)]
    """
    if not spec.strip():
        spec = "exact_match"
    out: list[RewardFunction] = []
    for entry in spec.split(","):
        target, eq, weight_text = entry.strip().partition("=")
        target = target.strip()
        if not target:
            raise ValueError(f"{key}: empty entry in {spec!r}; write NAME[=WEIGHT],... "
                             f"with built-ins {', '.join(BUILTIN_REWARDS)} or pkg.mod:fn")
        weight = 1.0
        if eq:
            try:
                weight = float(weight_text)
            except ValueError:
                weight = math.nan
            if not math.isfinite(weight):
                raise ValueError(f"{key}: {entry.strip()!r}: the weight {weight_text.strip()!r} "
                                 "is not a finite number (write NAME=0.5)")
        if target in BUILTIN_REWARDS:
            factory = BUILTIN_REWARDS[target]
            try:
                fn = factory(format_regex) if target == "regex_format" else factory()
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
            name = target
        elif ":" in target:
            fn = load_object(target, key)
            if not callable(fn):
                raise ValueError(f"{key}: {target!r} is a {type(fn).__name__}, not a function")
            name = _name_of(fn)
        else:
            raise ValueError(f"{key}: unknown reward {target!r}: not a built-in "
                             f"({', '.join(BUILTIN_REWARDS)}) nor an import path "
                             "(mymod:reward_fn or path/to/file.py:reward_fn)")
        if any(r.name == name for r in out):
            raise ValueError(f"{key}: two reward functions are named {name!r} (metric "
                             f"reward/{name}); name each one once, or rename one")
        out.append(RewardFunction(name, fn, weight))
    return tuple(out)


class RewardBatch(NamedTuple):
    """The rewards of a batch of B completions.

    Attributes:
      total_B: [B] f32: the sum over functions of weight * value, None values left out
        (TRL's nansum; a sample every function skips gets 0.0).
      parts: name -> [B] f32 values as returned (a failed sample's is the failure
        reward), NaN where None.
      failed: name -> samples that function failed on.
      seconds: wall seconds spent scoring.
    """

    total_B: np.ndarray
    parts: dict[str, np.ndarray]
    failed: dict[str, int]
    seconds: float

    def metrics(self) -> dict[str, float]:
        """`reward/<name>`: the mean of the values that apply (0.0 if none does);
        `reward_failed/<name>`: the failed samples."""
        out: dict[str, float] = {}
        for name, values in self.parts.items():
            applies = values[~np.isnan(values)]
            out[f"reward/{name}"] = float(applies.mean()) if applies.size else 0.0
            out[f"reward_failed/{name}"] = float(self.failed.get(name, 0))
        return out


_RESERVED = ("prompts", "completions", "completion_ids", "trainer_state")


def _invoke(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    out = fn(**kwargs)
    if inspect.isawaitable(out):  # an `async def` reward, as TRL allows
        async def wait():
            return await out
        out = asyncio.run(wait())
    return out


def _run_all(calls: Sequence[Callable[[], Any]],
             timeout_s: float) -> list[tuple[str, Any]]:
    """Each call on its own daemon thread, all at once, waited for at most `timeout_s`.

    The `envs.EnvRunner` pattern: a call still running at the deadline is left behind
    (never joined; its late answer goes to a queue nobody reads).

    Returns:
      Per call: ("ok", value), ("error", "Type: message") or ("timeout", None).
    """
    answers: queue.Queue = queue.Queue()

    def run(i: int, call: Callable[[], Any]) -> None:
        try:
            answers.put((i, "ok", call()))
        # BaseException too: a reward's `sys.exit()` would otherwise end its thread silently
        # and be reported, `timeout_s` later, as a hang.
        except BaseException as e:  # noqa: BLE001 - any failure of a user's reward is recorded
            answers.put((i, "error", " ".join(f"{type(e).__name__}: {e}".split())[:300]))

    deadline = time.perf_counter() + timeout_s
    for i, call in enumerate(calls):
        threading.Thread(target=run, args=(i, call), daemon=True, name=f"reward-{i}").start()
    out: list[tuple[str, Any]] = [("timeout", None)] * len(calls)
    for _ in calls:
        try:
            i, kind, value = answers.get(timeout=max(deadline - time.perf_counter(), 0.0))
        except queue.Empty:
            break
        out[i] = (kind, value)
    return out


def _check_values(value: Any, n: int) -> tuple[np.ndarray, np.ndarray, str | None]:
    """A function's answer read as [n] f64 values (NaN for None) and a [n] bool mask of
    the failed samples, with what went wrong on the first of them."""
    if not (isinstance(value, (list, tuple))
            or (isinstance(value, np.ndarray) and value.ndim == 1)):
        return (np.full(n, np.nan), np.ones(n, bool),
                f"returned {type(value).__name__}, not a list of {n} values")
    if len(value) != n:
        return (np.full(n, np.nan), np.ones(n, bool),
                f"returned {len(value)} values for {n} completions")
    values, bad, why = np.full(n, np.nan), np.zeros(n, bool), None
    for i, v in enumerate(value):
        if v is None:
            continue
        number = isinstance(v, (numbers.Real, np.bool_))
        if number and math.isfinite(float(v)):
            values[i] = float(v)
            continue
        bad[i] = True
        if why is None:
            why = (f"returned the non-finite value {float(v)}" if number
                   else f"returned {type(v).__name__} {str(v)[:40]!r}, not a number")
    return values, bad, why


class RewardScorer:
    """Scores batches of completions with a task's reward functions, each on a host thread
    with a timeout.

    Args:
      functions: `RewardFunction`s (or bare callables, named by `__name__`, weight 1).
      timeout_s: seconds the functions may take on a batch, > 0 (they run at once).
      failure_reward: the value of a sample a function failed on (when not strict).

    Examples:
      >>> def short(completions, **kwargs):
      ...     return [1.0 if len(c) < 4 else 0.0 for c in completions]
      >>> scorer = RewardScorer(parse_rewards("exact_match") + (RewardFunction("short", short, 0.5),))
      >>> batch = scorer.score(["2+2="] * 2, ["4", "five"], [[7], [8, 9]], {"answer": ["4", "5"]})
      >>> batch.total_B.tolist(), batch.metrics()["reward/short"]
      ([1.5, 0.0], 0.5)
    """

    def __init__(self, functions: Sequence[RewardFunction | Callable[..., Any]], *,
                 timeout_s: float = 60.0, failure_reward: float = 0.0):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not timeout_s > 0:
            raise ValueError(f"RewardScorer: timeout_s={timeout_s!r} must be a number > 0")
        if isinstance(failure_reward, bool) or not isinstance(failure_reward, (int, float)) \
                or not math.isfinite(failure_reward):
            raise ValueError(f"RewardScorer: failure_reward={failure_reward!r} must be a finite "
                             "number")
        fns = tuple(f if isinstance(f, RewardFunction) else RewardFunction(_name_of(f), f)
                    for f in functions)
        if not fns:
            raise ValueError("RewardScorer: no reward functions; give at least one")
        names = [f.name for f in fns]
        if len(set(names)) != len(names):
            raise ValueError(f"RewardScorer: reward functions share a name ({names}); each "
                             "name is a metric, reward/<name>")
        self.functions, self.timeout_s, self.failure_reward = fns, float(timeout_s), \
            float(failure_reward)
        self._accepts = tuple(self._keywords(f.fn) for f in fns)

    @staticmethod
    def _keywords(fn: Callable[..., Any]) -> frozenset[str] | None:
        """The keywords `fn` names, or None when it takes any (`**kwargs`)."""
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # no signature to read: pass everything, as TRL
            return None
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return None
        return frozenset(p.name for p in params
                         if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))

    def score(self, prompts: Sequence[Any], completions: Sequence[Any],
              completion_ids: Sequence[Sequence[int]], columns: Mapping[str, Sequence[Any]], *,
              strict: bool = False, describe: Callable[[int], str] | None = None,
              trainer_state: Any = None) -> RewardBatch:
        """Scores a batch: every function called once, all at once, each on its thread.

        Args:
          prompts: B prompts, strings or chat message lists.
          completions: B completion texts (a chat task's may be given as TRL's
            `[{"role": "assistant", "content": text}]`; a string is wrapped so).
          completion_ids: B lists of the completions' token ids.
          columns: the records' other fields, name -> B values, passed as keywords.
          strict: raise the first failure (the start probe) instead of scoring it
            `failure_reward`.
          describe: i -> a short description of sample i's record, for the failure line.
          trainer_state: what a function's `trainer_state` keyword receives.

        Returns:
          The `RewardBatch`.

        Raises:
          ValueError: inputs of different lengths or a reserved column name; with
            `strict`, a function's failure (one line naming it and the record).
        """
        t0 = time.perf_counter()
        n = len(completions)
        if len(prompts) != n or len(completion_ids) != n:
            raise ValueError(f"RewardScorer.score: {len(prompts)} prompts, {n} completions and "
                             f"{len(completion_ids)} completion_ids; give one of each per sample")
        for k, v in columns.items():
            if k in _RESERVED:
                raise ValueError(f"RewardScorer.score: a column named {k!r} would replace "
                                 f"the keyword of that name; rename it ({', '.join(_RESERVED)} "
                                 "are reserved)")
            if len(v) != n:
                raise ValueError(f"RewardScorer.score: column {k!r} has {len(v)} values for "
                                 f"{n} completions")
        completions = [[{"role": "assistant", "content": c}]
                       if isinstance(p, list) and isinstance(c, str) else c
                       for p, c in zip(prompts, completions, strict=True)]
        every = {"prompts": prompts, "completions": completions,
                 "completion_ids": completion_ids, **columns, "trainer_state": trainer_state}

        def call(accepts: frozenset[str] | None, fn: Callable[..., Any]) -> Callable[[], Any]:
            # Lists of their own: one function changing its input cannot change another's.
            kw = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in every.items()
                  if accepts is None or k in accepts}
            return functools.partial(_invoke, fn, kw)

        outcomes = _run_all([call(a, f.fn) for a, f in zip(self._accepts, self.functions,
                                                           strict=True)], self.timeout_s)
        parts, failed, lines = {}, {}, []
        for f, (kind, value) in zip(self.functions, outcomes, strict=True):
            if kind == "ok":
                values, bad, why = _check_values(value, n)
            else:
                values, bad = np.full(n, np.nan), np.ones(n, bool)
                why = (f"raised {value}" if kind == "error"
                       else f"did not return within {self.timeout_s:g} s")
            if bad.any():
                first = int(np.argmax(bad))
                where = describe(first) if describe is not None else f"sample {first}"
                lines.append((f.name, f"reward function {f.name!r} failed on {int(bad.sum())} "
                                      f"of {n} samples: {why} (first failing: {where})"))
                values[bad] = self.failure_reward
            parts[f.name] = values.astype(np.float32)
            failed[f.name] = int(bad.sum())
        if lines and strict:
            raise ValueError(lines[0][1])
        for name, line in lines:
            print(f"{line}; each scored {self.failure_reward:g}, counted in reward_failed/{name}",
                  file=sys.stderr, flush=True)
        weighted = np.stack([parts[f.name] * np.float32(f.weight) for f in self.functions])
        total_B = np.nansum(weighted, axis=0).astype(np.float32)
        return RewardBatch(total_B, parts, failed, time.perf_counter() - t0)
