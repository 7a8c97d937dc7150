"""What a task is: the typed protocols the trainer, `jaxrl-lp eval` and the library read.

A task hands the trainer its data, how a record becomes the sampler's prompt and how
completions are scored. The built-in tasks (`data.ArithmeticTask`, `data.GSM8KTask`,
`envs.CalculatorTask`, `envs.PythonCalculatorTask`, `tasks.DatasetTask`) implement
these protocols and nothing more: a user's object that implements them trains through
the same path (`run_train(cfg, task=...)`, a config file's `TASK`).

- `Task`: the common part: `tokenizer`, the `train` / `heldout` splits (random-access
  sequences of records), `prompt_ids(record)`, and the lengths the run is shaped by
  (`max_completion_tokens`, the default completion budget; `max_sequence_length`, the
  warm-start's padded length).
- `SingleTurnTask`: a `Task` that scores a batch of completions, `rewards(ids, records)`.
- `MultiTurnTask`: a `Task` whose episodes alternate model turns with an environment's
  observations: `make_env()`, `max_turns`, `max_turn_tokens`, `max_observation_tokens`,
  `stop_token_ids`; the environments' rewards score the episodes.
- `SupervisedTask`: what the warm-start reads, `sft_example(record)` (needed when
  `sft.steps > 0`).
- `ObservationEncoder`: a multi-turn task that renders an environment's result itself
  (e.g. a tool message through the checkpoint's chat template, `tasks.chat`); without
  it an observation's text is encoded by the task's tokenizer.

`check_task` is the boundary: it names in one line what an object lacks, before anything
is written. `task_fingerprint` identifies a task's data and shapes, so a resumed run
refuses another task.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jaxrl_lp.models.tokenizer import Tokenizer

__all__ = ["MultiTurnTask", "ObservationEncoder", "SingleTurnTask", "SupervisedTask", "Task",
           "check_task", "is_multiturn", "task_fingerprint"]


@runtime_checkable
class Task(Protocol):
    """What every task provides.

    Attributes:
      tokenizer: a `models.Tokenizer` with an EOS id (and a padding id).
      train: the training records, a random-access sequence (`len`, integer indexing).
      heldout: the evaluation records, disjoint from `train`.
      max_completion_tokens: the longest reference completion in tokens, EOS included:
        the completion budget when `grpo.max_new_tokens=0`.
      max_sequence_length: the longest prompt plus completion of the warm-start, in tokens.
    """

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def train(self) -> Sequence[Any]: ...

    @property
    def heldout(self) -> Sequence[Any]: ...

    @property
    def max_completion_tokens(self) -> int: ...

    @property
    def max_sequence_length(self) -> int: ...

    def prompt_ids(self, record: Any) -> list[int]:
        """The token ids the sampler is given for `record` (BOS or the chat template's
        opening included: nothing is added to them)."""
        ...


@runtime_checkable
class SingleTurnTask(Task, Protocol):
    """A task whose rollouts are one completion per prompt, scored by the task."""

    def rewards(self, completion_tokens_BxN: Any, records: Sequence[Any]) -> Any:
        """Rewards of a batch: row b of `completion_tokens_BxN` [B, N] (padded after its
        EOS) answers `records[b]`.

        Returns:
          [B] float32 rewards, or a `tasks.RewardBatch` (the total and each reward
          function's values, logged as `reward/<name>`).
        """
        ...


@runtime_checkable
class MultiTurnTask(Task, Protocol):
    """A task whose episodes alternate model turns and an environment's observations.

    Attributes:
      max_turns: model turns per episode at most.
      max_turn_tokens: tokens of one model turn at most (its stop token or EOS included).
      max_observation_tokens: tokens of one observation at most (a longer one ends the
        episode, reason `observation_overflow`).
      stop_token_ids: the tokens that end a model turn besides EOS (a tool call's end).
    """

    @property
    def max_turns(self) -> int: ...

    @property
    def max_turn_tokens(self) -> int: ...

    @property
    def max_observation_tokens(self) -> int: ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...

    def make_env(self) -> Any:
        """A fresh `envs.Environment` for one episode (reset from a record)."""
        ...


@runtime_checkable
class SupervisedTask(Protocol):
    """A task the warm-start can read."""

    def sft_example(self, record: Any) -> tuple:
        """(prompt_ids, completion_ids) or (prompt_ids, completion_ids, loss mask): the
        completion ends with EOS; a multi-turn episode's mask is 0 on observations."""
        ...


@runtime_checkable
class ObservationEncoder(Protocol):
    """A multi-turn task that turns an environment's result into the observation's tokens."""

    def observation_ids(self, result: Any, ended_by: str) -> list[int]:
        """The tokens appended after a turn that ended by `ended_by` (`eos`, `stop`,
        `length`) for the `envs.StepResult` `result` (text or chat messages)."""
        ...


_COMMON = ("tokenizer", "train", "heldout", "max_completion_tokens", "max_sequence_length",
           "prompt_ids")
_MULTI = ("make_env", "max_turns", "max_turn_tokens", "max_observation_tokens", "stop_token_ids")


def _lacks(task: Any, names: Sequence[str]) -> list[str]:
    return [n for n in names if not hasattr(task, n)]


def is_multiturn(task: Any) -> bool:
    """Whether `task` runs episodes of several turns (it makes environments)."""
    return isinstance(task, MultiTurnTask)


def check_task(task: Any, *, needs_sft: bool = False, key: str = "task") -> Any:
    """Checks that `task` is a task the trainer can run; returns it.

    A multi-turn task is one with `make_env`; every other is single-turn and needs
    `rewards`. The checks read the object, its tokenizer and its first records, and
    nothing is written.

    Args:
      task: the object.
      needs_sft: the run has warm-start steps (`sft.steps > 0`): `sft_example` is needed.
      key: how the message names the task (`task`, a config file's `TASK`).

    Raises:
      ValueError: one line naming what the object lacks or gets wrong.
    """
    name = type(task).__name__
    multi = hasattr(task, "make_env")
    lacking = _lacks(task, _COMMON + (_MULTI if multi else ("rewards",)))
    if needs_sft and not hasattr(task, "sft_example"):
        lacking.append("sft_example (sft.steps > 0 warm-starts from it; or set sft.steps=0)")
    if lacking:
        kind = "a multi-turn task (it has make_env)" if multi else "a single-turn task"
        raise ValueError(f"{key}: {name} is not {kind}: it lacks {', '.join(lacking)} "
                         "(docs/guide.md, 'Your own task', lists what a task provides)")
    tok = task.tokenizer
    if not isinstance(tok, Tokenizer):
        raise ValueError(f"{key}: {name}.tokenizer ({type(tok).__name__}) is not a "
                         "models.Tokenizer (vocab_size, bos_id, eos_id, pad_id, encode, decode)")
    if tok.eos_id is None or tok.pad_id is None:
        raise ValueError(f"{key}: {name}.tokenizer needs an EOS and a padding id (got eos_id="
                         f"{tok.eos_id}, pad_id={tok.pad_id}); a completion ends with EOS and "
                         "batches are padded")
    for split in ("train", "heldout"):
        records = getattr(task, split)
        try:
            n = len(records)
        except TypeError:
            raise ValueError(f"{key}: {name}.{split} is a {type(records).__name__} without "
                             "len(); pass a list or another random-access sequence") from None
        if n == 0:
            raise ValueError(f"{key}: {name}.{split} is empty; a run needs records in both "
                             "train and heldout")
    ids = task.prompt_ids(task.train[0])
    if (not isinstance(ids, (list, tuple)) or not ids
            or not all(isinstance(i, (int, np.integer)) and 0 <= i < tok.vocab_size
                       for i in ids)):
        raise ValueError(f"{key}: {name}.prompt_ids(train[0]) must be a non-empty list of token "
                         f"ids in [0, {tok.vocab_size}); got {str(ids)[:80]}")
    for attr in ("max_completion_tokens", "max_sequence_length"):
        v = getattr(task, attr)
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{key}: {name}.{attr} must be an int >= 1; got {v!r}")
    return task


def _describe(task: Any) -> dict:
    """What the fingerprint hashes: the type, the tokenizer's ids, the splits' sizes, the
    prompts of the first records of each split and the shapes the run takes from the task."""
    tok = task.tokenizer
    first = lambda split: [list(map(int, task.prompt_ids(split[i])))
                           for i in range(min(16, len(split)))]
    out = {
        "type": f"{type(task).__module__}.{type(task).__qualname__}",
        "tokenizer": [int(tok.vocab_size), tok.bos_id, tok.eos_id, tok.pad_id],
        "train": [len(task.train), first(task.train)],
        "heldout": [len(task.heldout), first(task.heldout)],
        "lengths": [int(task.max_completion_tokens), int(task.max_sequence_length)],
    }
    if is_multiturn(task):
        out["turns"] = [int(task.max_turns), int(task.max_turn_tokens),
                        int(task.max_observation_tokens), list(map(int, task.stop_token_ids))]
    extra = getattr(task, "fingerprint_extra", None)
    if callable(extra):  # what else identifies it: a reward set, a chat template's options
        out["extra"] = extra()
    return out


def task_fingerprint(task: Any) -> str:
    """A 16-hex-digit identifier of a task's data and shapes (`_describe`): equal for the
    same task built again, different for other data, another tokenizer or other limits.

    A task may add what else identifies it (its reward functions, its template options)
    through a `fingerprint_extra()` method returning JSON-serializable values.
    """
    text = json.dumps(_describe(task), sort_keys=True, default=str)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()
