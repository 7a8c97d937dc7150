"""The embedded multi-turn task: arithmetic that is hard in one pass, with a calculator tool.

A problem is `a op b` with operands of fixed widths (default a 3-digit times a
2-digit number), written `<bos>347*29=` as the arithmetic task writes it. In a
model turn the model either calls the calculator, writing an expression and the
stop character `?` (`347*29?`), and reads its answer as the observation (`10063;`),
or answers, writing the number and EOS (`10063`), which ends the episode: reward 1
for the right answer, else 0. A call the calculator cannot read (anything but
digits joined by `+-*`, or longer than `MAX_EXPRESSION`) gets the observation
`err;`: an observation, not a crash. A turn cut by the per-turn token limit ends the
episode with reward 0; so does running out of turns, which the sampler enforces
(`TurnLimits.max_turns`, reason `max_turns`). A turn is read from its tokens with
special tokens written out, so a stray `<pad>` inside an answer breaks the exact match
(as `data.rewards` does) instead of vanishing from the text.

The warm-start's episodes (`sft_example`) answer at once or, for a `tool_fraction`
of the problems (chosen by a hash of the prompt, so a problem's episode never
changes), call the tool first; the observation's tokens are masked out of the loss.
A small model cannot multiply 3 digits by 2 in one pass, and can copy an expression
and a result: GRPO then raises the tool-use rate and, with it, the solve rate.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from typing import Any

import numpy as np

from jaxrl_lp.data.arithmetic import OPS, ArithmeticProblem
from jaxrl_lp.data.pipeline import IndexedSplit, hash_fraction, in_heldout
from jaxrl_lp.envs.base import StepResult, Turn
from jaxrl_lp.models.tokenizer import CharTokenizer, Tokenizer

__all__ = ["CalculatorEnv", "CalculatorSplit", "CalculatorTask", "MAX_EXPRESSION",
           "evaluate_expression"]

# The longest expression the calculator reads, in characters.
MAX_EXPRESSION = 24
STOP = "?"  # ends a tool call
END = ";"  # ends the calculator's answer
_LEADING_ZEROS = re.compile(r"\b0+(\d)")


def evaluate_expression(text: str) -> int | None:
    """The value of digits joined by `+`, `-`, `*` (usual precedence), or None if `text` is
    anything else or longer than `MAX_EXPRESSION`.

    Examples:
      >>> evaluate_expression("347*29"), evaluate_expression("007+1"), evaluate_expression("2**3")
      (10063, 8, None)
    """
    if not text or len(text) > MAX_EXPRESSION or any(c not in "0123456789+-*" for c in text):
        return None
    # Numbers are read as decimals: Python's grammar refuses leading zeros ("007").
    text = _LEADING_ZEROS.sub(r"\1", text)
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return None

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            a, b = value(node.left), value(node.right)
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(
                node.op, ast.Sub) else a * b
        raise ValueError(ast.dump(node))

    try:
        return value(tree.body)
    except ValueError:
        return None


class CalculatorSplit(IndexedSplit):
    """A random-access, deterministic split of a `CalculatorTask` (item i is drawn from a
    generator seeded by (seed, split, i), redrawn until it lands in the split)."""

    def __init__(self, ops: str, digits: tuple[int, int], seed: int, heldout: bool,
                 heldout_fraction: float, size: int):
        self._ops, self._digits, self._seed = ops, digits, seed
        self._heldout, self._fraction, self._size = heldout, heldout_fraction, size

    def _item(self, i: int) -> Any:
        rng = np.random.default_rng([self._seed, int(self._heldout), i])
        (da, db) = self._digits
        while True:
            a = int(rng.integers(10 ** (da - 1), 10**da))
            b = int(rng.integers(10 ** (db - 1), 10**db))
            problem = ArithmeticProblem(a, self._ops[int(rng.integers(len(self._ops)))], b)
            if in_heldout(problem.prompt, self._fraction) == self._heldout:
                return problem


@dataclasses.dataclass(frozen=True)
class CalculatorTask:
    """Multi-turn arithmetic with a calculator tool (module docstring).

    Args:
      ops: the operations, distinct characters from "+-*".
      digits: (first operand's, second operand's) digits, each in [1, 9].
      seed: draws the splits.
      heldout_fraction: expected fraction of problems held out, in (0, 1).
      tool_fraction: share of warm-start episodes that call the calculator, in [0, 1].
      max_turns: model turns per episode at most (>= 1; 2 lets a call and an answer).
      max_turn_tokens: tokens of one model turn at most, its stop token or EOS included;
        None (the default) is the longest turn of a warm-start episode, the least allowed.
      size: the length of each split.
      tokenizer: a `CharTokenizer` (None: the default alphabet).

    Examples:
      >>> task = CalculatorTask()
      >>> env = task.make_env()
      >>> prompt = env.reset(task.train[0])  # BOS + "347*29="
      >>> task.max_turn_tokens, task.stop_token_ids == tuple(task.tokenizer.encode("?"))
      (7, True)
    """

    ops: str = "*"
    digits: tuple[int, int] = (3, 2)
    seed: int = 0
    heldout_fraction: float = 0.1
    tool_fraction: float = 0.3
    max_turns: int = 3
    max_turn_tokens: int | None = None
    size: int = 1 << 20
    tokenizer: Tokenizer | None = None

    def __post_init__(self):
        ops = "".join(self.ops)
        object.__setattr__(self, "ops", ops)
        if not ops or any(o not in OPS for o in ops) or len(set(ops)) != len(ops):
            raise ValueError(f"CalculatorTask: ops={ops!r} must be distinct characters from "
                             f"{''.join(OPS)!r}")
        digits = tuple(int(d) for d in self.digits)
        if len(digits) != 2 or not all(1 <= d <= 9 for d in digits):
            raise ValueError(f"CalculatorTask: digits={self.digits!r} must be two widths in "
                             "[1, 9], e.g. (3, 2)")
        object.__setattr__(self, "digits", digits)
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"CalculatorTask: heldout_fraction={self.heldout_fraction} must be "
                             "in (0, 1)")
        if not 0.0 <= self.tool_fraction <= 1.0:
            raise ValueError(f"CalculatorTask: tool_fraction={self.tool_fraction} must be in "
                             "[0, 1]")
        if not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"CalculatorTask: max_turns={self.max_turns!r} must be an int >= 1")
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"CalculatorTask: size={self.size!r} must be an int >= 1")
        least = self._warm_start_turn_tokens
        if self.max_turn_tokens is None:
            object.__setattr__(self, "max_turn_tokens", least)
        elif (not isinstance(self.max_turn_tokens, int) or isinstance(self.max_turn_tokens, bool)
              or self.max_turn_tokens < least):
            raise ValueError(f"CalculatorTask: max_turn_tokens={self.max_turn_tokens!r} must be "
                             f"an int >= {least} (the longest warm-start turn), or None")
        if self.tokenizer is None:
            object.__setattr__(self, "tokenizer", CharTokenizer())
        # One token per character: `max_observation_tokens` counts characters.
        if not isinstance(self.tokenizer, CharTokenizer) or any(
                c not in self.tokenizer.alphabet for c in "0123456789+-*=" + STOP + END):
            raise ValueError("CalculatorTask: tokenizer must be a CharTokenizer whose alphabet "
                             f"holds the digits and '+-*={STOP}{END}', or None")

    # ------------------------------------------------------------------ the data
    @functools.cached_property
    def train(self) -> CalculatorSplit:
        """The training problems (disjoint from `heldout`)."""
        return CalculatorSplit(self.ops, self.digits, self.seed, False, self.heldout_fraction,
                               self.size)

    @functools.cached_property
    def heldout(self) -> CalculatorSplit:
        """The held-out problems."""
        return CalculatorSplit(self.ops, self.digits, self.seed, True, self.heldout_fraction,
                               self.size)

    def prompt_ids(self, problem: ArithmeticProblem) -> list[int]:
        """BOS then the prompt text ("347*29=")."""
        return self.tokenizer.encode(problem.prompt, add_bos=True)

    @property
    def _longest_answer(self) -> int:
        """The longest answer text: the extremes of each op (a difference's longest is its
        most negative or its largest, whichever the widths make longer)."""
        top = [10**d - 1 for d in self.digits]
        low = [10 ** (d - 1) for d in self.digits]
        values = {"+": [top[0] + top[1]], "-": [low[0] - top[1], top[0] - low[1]],
                  "*": [top[0] * top[1]]}
        return max(len(str(v)) for o in self.ops for v in values[o])

    @property
    def _warm_start_turn_tokens(self) -> int:
        """The longest warm-start turn: a call ("347*29?") or an answer and EOS ("10063" EOS)."""
        return max(sum(self.digits) + 2, self._longest_answer + 1)

    @property
    def max_observation_tokens(self) -> int:
        """The calculator's longest answer to a call of one turn ("10063;", "err;").

        A call reads at most `min(max_turn_tokens - 1, MAX_EXPRESSION)` characters, and the
        value of digits joined by `+-*` is never longer, sign included, than the
        expression: by induction, `x*y` has at most len(x) + len(y) digits, `x±y` at most
        max(len(x), len(y)) + 1, one more for a sign, and the operator adds a character.
        """
        read = min(self.max_turn_tokens - 1, MAX_EXPRESSION)
        return max(read + len(END), len("err" + END))

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The token that ends a tool call."""
        return tuple(self.tokenizer.encode(STOP))

    @property
    def max_completion_tokens(self) -> int:
        """The longest warm-start completion: a call, its answer, the answer and EOS."""
        return ((sum(self.digits) + 2) + self._warm_start_turn_tokens
                + self._longest_answer + 1)

    @property
    def max_sequence_length(self) -> int:
        """The longest prompt + completion of the warm-start: its `seq_len`."""
        return 1 + sum(self.digits) + 2 + self.max_completion_tokens

    def solved(self, problem: ArithmeticProblem, total_reward: float) -> bool:
        """Whether an episode of `problem` with this summed reward answered it (reward 1)."""
        del problem  # the reward says it all: 1 for the right answer, else 0
        return total_reward >= 1.0

    def uses_tool(self, problem: ArithmeticProblem) -> bool:
        """Whether the warm-start's episode of `problem` calls the calculator."""
        return hash_fraction(f"tool:{self.seed}:{problem.prompt}") < self.tool_fraction

    def sft_example(self, problem: ArithmeticProblem) -> tuple[list[int], list[int], list[float]]:
        """(prompt_ids, completion_ids, loss mask): a scripted episode, the calculator's
        answer masked out.

        Whether the episode calls the tool is `uses_tool(problem)` (a hash of the prompt,
        not a generator): a problem's episode is the same in every epoch and every data
        shard, and `sft_loader` maps records with one argument.

        Returns:
          With the tool, "347*29?" + "10063;" + "10063" EOS with the mask 1 on the call,
          0 on the observation "10063;", 1 on the answer and EOS; without it, "10063" EOS
          and a mask of ones.
        """
        enc = self.tokenizer.encode
        answer = enc(problem.answer) + [self.tokenizer.eos_id]
        if not self.uses_tool(problem):
            return self.prompt_ids(problem), answer, [1.0] * len(answer)
        call = enc(f"{problem.a}{problem.op}{problem.b}{STOP}")
        observation = enc(f"{problem.answer}{END}")
        return (self.prompt_ids(problem), call + observation + answer,
                [1.0] * len(call) + [0.0] * len(observation) + [1.0] * len(answer))

    def make_env(self) -> CalculatorEnv:
        """A fresh environment for one episode."""
        return CalculatorEnv(self)


class CalculatorEnv:
    """One episode of a `CalculatorTask` (module docstring).

    Every result's `info` holds `tool_call` (this turn called the calculator),
    `tool_calls` (the episode's calls so far, this one included) and, on a call,
    `tool_ok`; a turn cut by the token limit adds `truncated`.
    """

    def __init__(self, task: CalculatorTask):
        self.task, self.problem = task, None
        self.tool_calls, self.done = 0, False

    def reset(self, problem: ArithmeticProblem) -> list[int]:
        self.problem, self.tool_calls, self.done = problem, 0, False
        return self.task.prompt_ids(problem)

    def step(self, turn: Turn) -> StepResult:
        if self.problem is None:
            raise RuntimeError("CalculatorEnv.step before reset")
        if self.done:
            raise RuntimeError("CalculatorEnv.step after the episode ended; reset it first")
        text = self.task.tokenizer.decode(turn.tokens, skip_special=False)
        if turn.ended_by == "stop":  # a tool call
            self.tool_calls += 1
            value = evaluate_expression(text.removesuffix(STOP))
            info = {"tool_call": True, "tool_calls": self.tool_calls, "tool_ok": value is not None}
            return StepResult(observation=("err" if value is None else str(value)) + END,
                              info=info)
        self.done = True
        info = {"tool_call": False, "tool_calls": self.tool_calls}
        if turn.ended_by == "eos":  # the answer
            right = text == self.problem.answer
            return StepResult(reward=1.0 if right else 0.0, done=True, info=info)
        return StepResult(done=True, info={**info, "truncated": True})
