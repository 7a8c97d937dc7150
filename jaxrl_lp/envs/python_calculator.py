"""GSM8K with a calculator tool: the model writes `<calc>EXPR</calc>`, reads `<result>VALUE</result>`.

For real checkpoints and their tokenizers (`GSM8KTask`'s records and prompts). A model
turn ends on EOS, on a token whose text ends with `>` (the stop tokens: the end of
`</calc>` whatever the tokenizer's merges), or at the per-turn limit. A turn whose text
ends with a complete `<calc>...</calc>` is a tool call: the expression is evaluated by
`safe_eval` (numbers, `+ - * / // % **`, parentheses; nothing else) and answered
`<result>VALUE</result>` or `<result>error</result>`. A turn that stopped on another
`>` gets no observation and the model goes on writing. A turn that ends with EOS ends
the episode, rewarded by `data.rewards.gsm8k_reward` on the text of all its turns.

The warm-start's episodes come from GSM8K's calculator annotations: `<<48/2=24>>`
becomes the model's `<calc>48/2</calc>` and the observation `<result>24</result>`
(masked out of the loss).
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
_CALL = re.compile(r"<calc>(.*?)</calc>\s*$", re.S)
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
      max_turns: model turns per episode at most.
      max_turn_tokens: tokens of one model turn at most.
      max_observation_tokens: tokens of one observation at most.
    """

    base: GSM8KTask
    max_turns: int = 8
    max_turn_tokens: int = 128
    max_observation_tokens: int = 16

    def __post_init__(self):
        for name in ("max_turns", "max_turn_tokens", "max_observation_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"PythonCalculatorTask: {name}={v!r} must be an int >= 1")

    @property
    def tokenizer(self):
        return self.base.tokenizer

    @property
    def train(self):
        return self.base.train

    @property
    def heldout(self):
        return self.base.heldout

    def prompt_ids(self, record: dict[str, str]) -> list[int]:
        return self.base.prompt_ids(record)

    @functools.cached_property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokens whose text ends with `>` (the end of `</calc>` whatever the merges)."""
        tok = self.tokenizer
        return tuple(i for i in range(tok.vocab_size)
                     if tok.decode([i], skip_special=True).endswith(">"))

    def sft_example(self, record: dict[str, str]) -> tuple[list[int], list[int], list[float]]:
        """(prompt_ids, completion_ids, loss mask): the reference answer with its annotations
        as calls and results; the results masked out."""
        enc = self.tokenizer.encode
        completion, mask = [], []
        text, at = " " + record["answer"], 0
        for m in _ANNOTATION.finditer(text):
            model = enc(text[at:m.start()] + f"<calc>{m.group(1)}</calc>")
            observation = enc(f"<result>{m.group(2)}</result>")
            completion += model + observation
            mask += [1.0] * len(model) + [0.0] * len(observation)
            at = m.end()
        tail = enc(text[at:], add_eos=True)
        return self.prompt_ids(record), completion + tail, mask + [1.0] * len(tail)

    @functools.cached_property
    def _lengths(self) -> tuple[int, int]:
        records = [*self.base.records, *(self.base.heldout_records or ())]
        return (max(len(self.prompt_ids(r)) for r in records),
                max(len(self.sft_example(r)[1]) for r in records))

    @property
    def max_completion_tokens(self) -> int:
        """The longest warm-start completion, in tokens."""
        return self._lengths[1]

    @property
    def max_sequence_length(self) -> int:
        """The longest prompt plus the longest warm-start completion: the SFT `seq_len`."""
        return sum(self._lengths)

    def make_env(self) -> PythonCalculatorEnv:
        return PythonCalculatorEnv(self)


class PythonCalculatorEnv:
    """One GSM8K episode with the calculator (module docstring)."""

    def __init__(self, task: PythonCalculatorTask):
        self.task, self.record, self.text = task, None, ""

    def reset(self, record: dict[str, str]) -> list[int]:
        self.record, self.text = record, ""
        return self.task.prompt_ids(record)

    def step(self, turn: Turn) -> StepResult:
        if self.record is None:
            raise RuntimeError("PythonCalculatorEnv.step before reset")
        self.text += turn.text
        if turn.ended_by == "eos":
            return StepResult(reward=gsm8k_reward(self.text, self.record["answer"]), done=True,
                              info={"tool_call": False})
        if turn.ended_by == "length":
            return StepResult(done=True, info={"tool_call": False, "truncated": True})
        call = _CALL.search(turn.text)
        if call is None:  # a `>` that ends no call: the model goes on
            return StepResult(info={"tool_call": False})
        try:
            value, ok = _show(safe_eval(call.group(1))), True
        except ValueError:
            value, ok = "error", False
        observation = f"<result>{value}</result>"
        self.text += observation
        return StepResult(observation=observation, info={"tool_call": True, "tool_ok": ok})
