"""What an environment is: it starts an episode from a record and answers each model turn.

A multi-turn task makes one `Environment` per episode; the sampler
(`rollout.multiturn`, through `train.episodes`) decodes a model turn until a stop
condition, hands it over as a `Turn`, and appends the `StepResult`'s observation to
the context, until a result says `done`. An episode's reward is the sum of its
turns' rewards.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

__all__ = ["ENDINGS", "Environment", "StepResult", "Turn"]

# How the sampler ended a model turn: EOS, a stop token, or the per-turn token limit.
ENDINGS = ("eos", "stop", "length")


@dataclasses.dataclass(frozen=True)
class Turn:
    """One model turn as the sampler ended it.

    Attributes:
      tokens: the turn's token ids, its stop token included, EOS excluded.
      text: the tokens decoded (special tokens skipped).
      ended_by: `eos`, `stop` (a stop token) or `length` (the per-turn limit).
    """

    tokens: tuple[int, ...]
    text: str
    ended_by: str

    def __post_init__(self):
        if self.ended_by not in ENDINGS:
            raise ValueError(f"Turn.ended_by={self.ended_by!r}: one of {list(ENDINGS)}")
        if not isinstance(self.text, str):
            raise ValueError(f"Turn.text={self.text!r}: a str, the tokens decoded")
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))


@dataclasses.dataclass(frozen=True)
class StepResult:
    """An environment's answer to a turn.

    Attributes:
      observation: text appended to the context after the turn ("" for none); the
        task's tokenizer encodes it.
      messages: chat messages answering the turn instead of `observation` (e.g. one
        `{"role": "tool", "content": "42"}` per tool call): the task renders them with its
        chat template (`tasks.ObservationEncoder`), as the conversation's next messages.
      reward: this turn's reward, a finite number (an episode's is the sum of its turns').
      done: the episode ended (no observation is appended then).
      info: facts for the metrics: `tool_call` (the turn called a tool), `tool_calls`
        (the episode's calls so far), `tool_ok` (the tool answered), `tool_error` (why
        it did not), `truncated` (the turn hit the token limit), `failed` (the runner's
        reason when the environment failed).

    Examples:
      >>> call = StepResult(observation="10063;", info={"tool_call": True, "tool_ok": True})
      >>> answer = StepResult(reward=1.0, done=True)
      >>> tool = StepResult(messages=({"role": "tool", "content": "10063"},))
    """

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    messages: tuple[Mapping[str, Any], ...] = ()

    def __post_init__(self):
        # Checked here, in the environment's own call, so a malformed result is that
        # episode's recorded failure (`EnvRunner`), not a crash of the sampler's loop.
        if not isinstance(self.observation, str):
            raise ValueError(f"StepResult.observation={self.observation!r}: a str ('' for none)")
        if isinstance(self.reward, bool) or not isinstance(self.reward, numbers.Real) \
                or not math.isfinite(self.reward):
            raise ValueError(f"StepResult.reward={self.reward!r}: a finite number")
        if not isinstance(self.done, (bool, np.bool_)):
            raise ValueError(f"StepResult.done={self.done!r}: True or False")
        if not isinstance(self.info, Mapping):
            raise ValueError(f"StepResult.info={self.info!r}: a mapping (a dict)")
        messages = tuple(self.messages) if isinstance(self.messages, (list, tuple)) else None
        if messages is None or not all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages):
            raise ValueError(f"StepResult.messages={self.messages!r}: chat messages, each a "
                             "dict with a str 'role' and 'content'")
        if messages and self.observation:
            raise ValueError("StepResult: give the observation as text or as messages, not both")
        object.__setattr__(self, "messages", messages)
        object.__setattr__(self, "reward", float(self.reward))
        object.__setattr__(self, "done", bool(self.done))


class Environment(Protocol):
    """One episode's environment."""

    def reset(self, record: Any) -> list[int]:
        """Starts an episode of `record`; returns its prompt's token ids (BOS first)."""
        ...

    def step(self, turn: Turn) -> StepResult:
        """Answers a model turn."""
        ...
