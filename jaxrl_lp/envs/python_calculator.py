"""GSM8K with a calculator tool: the model writes `<calc>EXPR</calc>`, reads `<result>VALUE</result>`.

For real checkpoints and their tokenizers (`GSM8KTask`'s records and prompts). A model
turn ends on EOS, on a token whose text ends with `>` (the stop tokens: the end of
`</calc>` whatever the tokenizer's merges), or at the per-turn limit.

A stop token cannot tell `</calc>` from `<calc>` or from a `>` in the text (with most
tokenizers all three end on the same `>` token), so the environment reads the model's
text since the last observation, however many turns it took: when it ends with a
complete `<calc>EXPR</calc>`, that is a tool call, answered `<result>VALUE</result>`
(`safe_eval`: numbers, `+ - * / // % **`, parentheses; nothing else) or
`<result>error</result>` (the reason in `info["tool_error"]`); otherwise the turn gets
no observation and the model goes on writing. Each such stop still counts against
`max_turns`: a call usually takes two turns (one stops on `<calc>`, one on `</calc>`);
`warm_start_turns` says how many turns the warm-start's episodes take. A turn that ends
with EOS ends the episode, rewarded by `data.rewards.gsm8k_reward` on the episode's text
(turns and observations); a turn cut by the per-turn limit ends it with reward 0.

The warm-start's episodes come from GSM8K's calculator annotations: `<<48/2=24>>`
becomes the model's `<calc>48/2</calc>` and the observation the environment would give,
`<result>24</result>` (masked out of the loss); an annotation `safe_eval` cannot read is
dropped, the text around it kept.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
import operator
import re

from jaxrl_lp.data.gsm8k import GSM8KTask
from jaxrl_lp.data.rewards import gsm8k_reward
from jaxrl_lp.envs.base import StepResult, Turn

__all__ = ["PythonCalculatorEnv", "PythonCalculatorTask", "safe_eval"]

_ANNOTATION = re.compile(r"<<([^<>=]+)=([^<>]*)>>")
OPEN, CLOSE = "<calc>", "</calc>"
ERROR = "<result>error</result>"
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
MAX_MAGNITUDE = 1e15  # a larger intermediate value is an error
MAX_EXPONENT = 10


def safe_eval(text: str) -> float | int:
    """The value of an arithmetic expression: numbers, `+ - * / // % **` (exponents within
    `MAX_EXPONENT`), unary signs and parentheses.

    Raises:
      ValueError: anything else (names, calls, attributes, ...), a division by zero, or a
        value beyond `MAX_MAGNITUDE`.

    Examples:
      >>> safe_eval("48/2"), safe_eval("(3+4)*5"), safe_eval("2**-1")
      (24.0, 35, 0.5)
    """
    if len(text) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        tree = ast.parse(text.replace(",", "").strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {e.msg}") from None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            out = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            out = -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            a, b = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) > MAX_EXPONENT:
                raise ValueError(f"exponent {b} beyond {MAX_EXPONENT}")
            try:
                out = _BINARY[type(node.op)](a, b)
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
        else:
            raise ValueError(f"{type(node).__name__} is not arithmetic")
        if isinstance(out, complex) or not math.isfinite(out) or abs(out) > MAX_MAGNITUDE:
            raise ValueError("value out of range")
        return out

    return value(tree.body)


def _result(expression: str) -> str:
    """The calculator's observation of a readable expression (`safe_eval`'s errors raise)."""
    return f"<result>{_show(safe_eval(expression))}</result>"


def _call(text: str) -> str | None:
    """The expression of the call that `text` ends with (`...<calc>EXPR</calc>`), or None."""
    body = text.rstrip()
    if not body.endswith(CLOSE):
        return None
    start = body.rfind(OPEN, 0, len(body) - len(CLOSE))
    return None if start < 0 else body[start + len(OPEN):len(body) - len(CLOSE)]


def _show(v: float | int) -> str:
    """A value as GSM8K writes one: an integer without a decimal point."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return str(v) if isinstance(v, int) else f"{v:.10g}"


@dataclasses.dataclass(frozen=True)
class PythonCalculatorTask:
    """A `GSM8KTask`'s records as multi-turn episodes with a calculator (module docstring).

    Args:
      base: the GSM8K task (records, tokenizer, prompt template).
      max_turns: model turns per episode at most (a stop on `<calc>` counts as one).
      max_turn_tokens: tokens of one model turn at most.
      max_observation_tokens: tokens of one observation at most; None (the default) is
        the longest the warm-start's episodes read (their results, and the error). A
        result that would be longer is answered `<result>error</result>` (`tool_error`
        says why), so no observation overflows the sampler's limit; pass a larger value
        to let the model read longer results (each observation chunk then takes more
        cache slots).

    Examples:
      >>> task = PythonCalculatorTask(GSM8KTask(records, tokenizer))
      >>> env = task.make_env()
      >>> prompt_ids = env.reset(task.train[0])
      >>> env.step(Turn(ids, "so 48/2 = <calc>48/2</calc>", "stop")).observation
      '<result>24</result>'
    """

    base: GSM8KTask
    max_turns: int = 8
    max_turn_tokens: int = 128
    max_observation_tokens: int | None = None

    def __post_init__(self):
        if not isinstance(self.base, GSM8KTask):
            raise ValueError(f"PythonCalculatorTask: base={type(self.base).__name__} must be a "
                             "GSM8KTask")
        for name in ("max_turns", "max_turn_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"PythonCalculatorTask: {name}={v!r} must be an int >= 1")
        least = len(self.tokenizer.encode(ERROR))
        v = self.max_observation_tokens
        if v is None:  # the data's longest result: every warm-start observation fits
            longest = least
            for r in [*self.base.records, *(self.base.heldout_records or ())]:
                for m in _ANNOTATION.finditer(r["answer"]):
                    try:
                        longest = max(longest, len(self.tokenizer.encode(_result(m.group(1)))))
                    except ValueError:  # unreadable: `sft_example` drops it
                        pass
            object.__setattr__(self, "max_observation_tokens", longest)
        elif not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ValueError(f"PythonCalculatorTask: max_observation_tokens={v!r} must be an "
                             f"int >= {least} (the tokens of {ERROR!r}), or None")

    @property
    def tokenizer(self):
        """The base task's tokenizer."""
        return self.base.tokenizer

    @property
    def train(self):
        """The base task's training records."""
        return self.base.train

    @property
    def heldout(self):
        """The base task's held-out records."""
        return self.base.heldout

    def prompt_ids(self, record: dict[str, str]) -> list[int]:
        """The base task's prompt: BOS (if the tokenizer has one) then the filled template."""
        return self.base.prompt_ids(record)

    @functools.cached_property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokens whose text ends with `>` (the end of `</calc>` whatever the merges)."""
        tok = self.tokenizer
        return tuple(i for i in range(tok.vocab_size)
                     if tok.decode([i], skip_special=True).endswith(">"))

    def solved(self, record: dict[str, str], total_reward: float) -> bool:
        """Whether an episode of `record` with this summed reward answered it (reward 1)."""
        del record  # the reward is 1 exactly when the answer is right
        return total_reward >= 1.0

    def answer(self, expression: str) -> tuple[str, dict[str, object]]:
        """The calculator's observation for `expression` and its facts (`tool_ok`, and
        `tool_error` when it failed): what the environment answers, and what the
        warm-start's episodes read."""
        try:
            observation = _result(expression)
        except ValueError as e:
            return ERROR, {"tool_ok": False, "tool_error": str(e)[:100]}
        if len(self.tokenizer.encode(observation)) > self.max_observation_tokens:
            return ERROR, {"tool_ok": False, "tool_error": "result longer than "
                           f"max_observation_tokens={self.max_observation_tokens}"}
        return observation, {"tool_ok": True}

    def sft_example(self, record: dict[str, str]) -> tuple[list[int], list[int], list[float]]:
        """(prompt_ids, completion_ids, loss mask): the reference answer with its annotations
        as calls and the environment's results, the results masked out.

        Returns:
          For "... 48/2 = <<48/2=24>>24 ...": the model's " ... 48/2 = <calc>48/2</calc>",
          the observation "<result>24</result>" (mask 0), the model's "24 ..." and EOS.
        """
        enc = self.tokenizer.encode
        completion, mask = [], []
        text, at, model = " " + record["answer"], 0, ""
        for m in _ANNOTATION.finditer(text):
            model += text[at:m.start()]
            at = m.end()
            observation, facts = self.answer(m.group(1))
            if not facts["tool_ok"]:  # an annotation the calculator cannot read: dropped
                continue
            ids, obs = enc(model + f"{OPEN}{m.group(1)}{CLOSE}"), enc(observation)
            completion += ids + obs
            mask += [1.0] * len(ids) + [0.0] * len(obs)
            model = ""
        tail = enc(model + text[at:], add_eos=True)
        return self.prompt_ids(record), completion + tail, mask + [1.0] * len(tail)

    @functools.cached_property
    def _lengths(self) -> tuple[int, int, int]:
        records = [*self.base.records, *(self.base.heldout_records or ())]
        stops, longest_prompt, longest, turns = set(self.stop_token_ids), 0, 0, 0
        for r in records:
            prompt, completion, mask = self.sft_example(r)
            longest_prompt, longest = max(longest_prompt, len(prompt)), max(longest, len(completion))
            stopped = sum(1 for t, m in zip(completion, mask, strict=True) if m and t in stops)
            turns = max(turns, stopped + 1)  # every stop, then the EOS turn
        return longest_prompt, longest, turns

    @property
    def max_completion_tokens(self) -> int:
        """The longest warm-start completion, in tokens."""
        return self._lengths[1]

    @property
    def max_sequence_length(self) -> int:
        """The longest prompt plus the longest warm-start completion: the SFT `seq_len`."""
        return self._lengths[0] + self._lengths[1]

    @property
    def warm_start_turns(self) -> int:
        """The most model turns a warm-start episode takes with this tokenizer's stop tokens
        (over every record): a `max_turns` below it cuts those episodes short."""
        return self._lengths[2]

    def make_env(self) -> PythonCalculatorEnv:
        """A fresh environment for one episode."""
        return PythonCalculatorEnv(self)


class PythonCalculatorEnv:
    """One GSM8K episode with the calculator (module docstring).

    Every result's `info` holds `tool_call` (this turn completed a call), `tool_calls`
    (the episode's calls so far) and, on a call, `tool_ok` (and `tool_error` when it
    failed); a turn cut by the token limit adds `truncated`.
    """

    def __init__(self, task: PythonCalculatorTask):
        self.task, self.record = task, None
        self.text, self.pending, self.tool_calls, self.done = "", "", 0, False

    def reset(self, record: dict[str, str]) -> list[int]:
        self.record, self.text, self.pending, self.tool_calls, self.done = record, "", "", 0, False
        return self.task.prompt_ids(record)

    def step(self, turn: Turn) -> StepResult:
        if self.record is None:
            raise RuntimeError("PythonCalculatorEnv.step before reset")
        if self.done:
            raise RuntimeError("PythonCalculatorEnv.step after the episode ended; reset it first")
        self.text += turn.text
        self.pending += turn.text  # the model's text since the last observation
        info: dict[str, object] = {"tool_call": False, "tool_calls": self.tool_calls}
        if turn.ended_by == "eos":
            self.done = True
            return StepResult(reward=gsm8k_reward(self.text, self.record["answer"]), done=True,
                              info=info)
        if turn.ended_by == "length":
            self.done = True
            return StepResult(done=True, info={**info, "truncated": True})
        expression = _call(self.pending)
        if expression is None:  # a `>` that closes no call: the model goes on
            return StepResult(info=info)
        observation, facts = self.task.answer(expression)
        self.tool_calls += 1
        self.text += observation
        self.pending = ""
        return StepResult(observation=observation,
                          info={"tool_call": True, "tool_calls": self.tool_calls, **facts})
