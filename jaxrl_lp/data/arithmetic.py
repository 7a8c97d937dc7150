"""The generated arithmetic task: `<bos>23+58=` -> `81<eos>`, with an exact-answer reward.

Operands are uniform in [0, 10**max_digits); subtraction answers may be
negative ("-35"). A problem belongs to the held-out split when a stable hash of
its prompt text says so (`pipeline.in_heldout`), independently of the seed, so
the two splits never share a problem and every seed holds out the same ones.

Small problem spaces (at most `max_enumerate` problems, e.g. 2-digit addition:
10**4) are enumerated, each split in a seeded order. Larger ones are sampled:
item i of a split is drawn from a generator seeded by (seed, split, i),
redrawing until it lands in that split, so it is random-access and
deterministic without being stored.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_lp.data.pipeline import IndexedSplit, in_heldout
from jaxrl_lp.data.rewards import exact_match_reward, score_completions
from jaxrl_lp.models.tokenizer import CharTokenizer, Tokenizer

__all__ = ["OPS", "ArithmeticProblem", "ArithmeticSplit", "ArithmeticTask"]

# The operations an arithmetic task may use (`ArithmeticTask.ops` draws from these).
OPS = ("+", "-", "*")


@dataclasses.dataclass(frozen=True)
class ArithmeticProblem:
    """One problem `a op b`.

    Attributes:
      a: left operand, >= 0.
      op: "+", "-" or "*".
      b: right operand, >= 0.
    """

    a: int
    op: str
    b: int

    @property
    def prompt(self) -> str:
        """The prompt text without BOS, e.g. "23+58="."""
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> str:
        """The exact answer text, e.g. "81"."""
        if self.op == "+":
            return str(self.a + self.b)
        if self.op == "-":
            return str(self.a - self.b)
        return str(self.a * self.b)


class ArithmeticSplit(IndexedSplit):
    """A random-access, deterministic split of the task (what `prompt_loader` takes).

    Built by `ArithmeticTask`; index it or iterate it like a list of `ArithmeticProblem`.
    """

    def __init__(self, ops: str, max_digits: int, seed: int, heldout: bool,
                 heldout_fraction: float, max_enumerate: int, sampled_size: int):
        self._ops, self._n = ops, 10**max_digits
        self._seed, self._heldout, self._fraction = seed, heldout, heldout_fraction
        self._table: np.ndarray | None = None
        self._size = sampled_size
        if len(ops) * self._n**2 <= max_enumerate:
            self._table = self._enumerate()
            self._size = len(self._table)
            if self._size == 0:
                name = "heldout" if heldout else "train"
                raise ValueError(f"ArithmeticTask: the {name} split is empty; move "
                                 f"heldout_fraction={heldout_fraction} away from 0 or 1")

    def _enumerate(self) -> np.ndarray:
        rows = [(o, a, b) for o, op in enumerate(self._ops) for a in range(self._n)
                for b in range(self._n)
                if in_heldout(f"{a}{op}{b}=", self._fraction) == self._heldout]
        table = np.asarray(rows, np.int64).reshape(-1, 3)
        order = np.random.default_rng([self._seed, int(self._heldout)]).permutation(len(table))
        return table[order]

    def _item(self, i: int) -> Any:
        if self._table is not None:
            o, a, b = (int(v) for v in self._table[i])
            return ArithmeticProblem(a, self._ops[o], b)
        rng = np.random.default_rng([self._seed, int(self._heldout), i])
        while True:
            o, a, b = (int(v) for v in rng.integers(0, [len(self._ops), self._n, self._n]))
            problem = ArithmeticProblem(a, self._ops[o], b)
            if in_heldout(problem.prompt, self._fraction) == self._heldout:
                return problem


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """The arithmetic task: splits, tokenization for SFT and rollouts, and the reward.

    Args:
      ops: the operations, a string of distinct characters from "+-*".
      max_digits: operands are in [0, 10**max_digits).
      seed: orders the splits (and draws them, for sampled spaces).
      heldout_fraction: expected fraction of problems held out, in (0, 1).
      tokenizer: a `Tokenizer` with BOS and EOS; None uses `CharTokenizer()`.
      format_reward: credit for a wrong but well-formed integer answer; 0.0 is exact-match.
      reverse_answer: the model writes the answer least significant digit first
        (`target`), the order in which carries propagate; small models learn it
        far faster than the usual order.
      pad_operands: operands are zero-padded to `max_digits`, so every digit
        sits at a fixed distance from "=" (again much easier for small models).
      max_enumerate: enumerate the problem space when it has at most this many problems.
      sampled_size: the length of each split of a sampled (larger) space.

    Examples:
      >>> task = ArithmeticTask(ops="+", max_digits=2, seed=0)
      >>> p = task.train[0]
      >>> prompt_ids, completion_ids = task.sft_example(p)
      >>> task.reward(p.answer, p), task.reward(p.answer + "0", p), task.reward(None, p)
      (1.0, 0.0, 0.0)
    """

    ops: str = "+"
    max_digits: int = 2
    seed: int = 0
    heldout_fraction: float = 0.1
    tokenizer: Tokenizer | None = None
    format_reward: float = 0.0
    reverse_answer: bool = False
    pad_operands: bool = False
    max_enumerate: int = 1 << 20
    sampled_size: int = 1 << 20

    def __post_init__(self):
        ops = "".join(self.ops)  # a tuple like ("+", "-") is accepted too
        object.__setattr__(self, "ops", ops)
        if not ops or any(o not in OPS for o in ops) or len(set(ops)) != len(ops):
            raise ValueError(f"ArithmeticTask: ops={ops!r} must be distinct characters from "
                             f"{''.join(OPS)!r}, e.g. '+' or '+-'")
        if not 1 <= self.max_digits <= 9:
            raise ValueError(f"ArithmeticTask: max_digits={self.max_digits} must be in [1, 9]")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"ArithmeticTask: heldout_fraction={self.heldout_fraction} must be "
                             "in (0, 1)")
        if not 0.0 <= self.format_reward < 1.0:
            raise ValueError(f"ArithmeticTask: format_reward={self.format_reward} must be in "
                             "[0, 1) so a right answer always beats a wrong one")
        if self.tokenizer is None:
            object.__setattr__(self, "tokenizer", CharTokenizer())
        if self.tokenizer.bos_id is None or self.tokenizer.eos_id is None:
            raise ValueError("ArithmeticTask: the tokenizer needs BOS and EOS ids (prompts "
                             "start with BOS, completions end with EOS)")

    def _split(self, heldout: bool) -> ArithmeticSplit:
        return ArithmeticSplit(self.ops, self.max_digits, self.seed, heldout,
                               self.heldout_fraction, self.max_enumerate, self.sampled_size)

    @functools.cached_property
    def train(self) -> ArithmeticSplit:
        """The training problems (disjoint from `heldout`)."""
        return self._split(heldout=False)

    @functools.cached_property
    def heldout(self) -> ArithmeticSplit:
        """The held-out problems for evaluation."""
        return self._split(heldout=True)

    @property
    def max_completion_tokens(self) -> int:
        """The longest completion in tokens, EOS included: use it as `max_new_tokens`.

        Counted on the answers of largest magnitude, which are the longest for a
        tokenizer with one token per digit (`CharTokenizer`, most LLM tokenizers).
        """
        top = 10**self.max_digits - 1
        extremes = {"+": 2 * top, "-": -top, "*": top * top}
        return 1 + max(len(self.tokenizer.encode(str(extremes[o]))) for o in self.ops)

    @property
    def max_sequence_length(self) -> int:
        """The longest prompt + completion in tokens (BOS and EOS included): an SFT `seq_len`."""
        top = 10**self.max_digits - 1
        prompt = max(len(self.prompt_ids(ArithmeticProblem(top, o, top))) for o in self.ops)
        return prompt + self.max_completion_tokens

    def prompt_text(self, problem: ArithmeticProblem) -> str:
        """The prompt, operands zero-padded to `max_digits` when `pad_operands` ("08+84=")."""
        if not self.pad_operands:
            return problem.prompt
        w = self.max_digits
        return f"{problem.a:0{w}d}{problem.op}{problem.b:0{w}d}="

    def prompt_ids(self, problem: ArithmeticProblem) -> list[int]:
        """BOS then the prompt text: what the sampler is given."""
        return self.tokenizer.encode(self.prompt_text(problem), add_bos=True)

    def target(self, problem: ArithmeticProblem) -> str:
        """The completion text the model must write: the answer, digits reversed if
        `reverse_answer` (least significant first, sign kept in front: "-35" -> "-53")."""
        a = problem.answer
        if not self.reverse_answer:
            return a
        sign, digits = ("-", a[1:]) if a.startswith("-") else ("", a)
        return sign + digits[::-1]

    def sft_example(self, problem: ArithmeticProblem) -> tuple[list[int], list[int]]:
        """(prompt_ids, completion_ids) for the warm-start: BOS+"23+58=" and "81"+EOS."""
        return self.prompt_ids(problem), self.tokenizer.encode(self.target(problem), add_eos=True)

    def reward(self, completion_text: str | None, problem: ArithmeticProblem) -> float:
        """Exact-answer reward of a completion's text before EOS (None: it never ended).

        Args:
          completion_text: from `rewards.completion_text`.
          problem: the problem it answers.

        Returns:
          1.0 if the text is exactly `problem.answer`, else 0.0 (or `format_reward`
          for a wrong but well-formed integer).
        """
        return exact_match_reward(completion_text, self.target(problem),
                                  format_reward=self.format_reward)

    def rewards(self, completion_tokens_BxN: Any,
                problems: Sequence[ArithmeticProblem]) -> np.ndarray:
        """[B] float32 rewards of a batch of completion ids (row b answers `problems[b]`)."""
        return score_completions(completion_tokens_BxN, problems, self.tokenizer, self.reward)
