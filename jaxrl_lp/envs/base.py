"""What an environment is: it starts an episode from a record and answers each model turn.

A multi-turn task makes one `Environment` per episode; the sampler
(`rollout.multiturn`, through `train.episodes`) decodes a model turn until a stop
condition, hands it over as a `Turn`, and appends the `StepResult`'s observation to
the context, until a result says `done`. An episode's reward is the sum of its
turns' rewards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

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


@dataclasses.dataclass(frozen=True)
class StepResult:
    """An environment's answer to a turn.

    Attributes:
      observation: text appended to the context after the turn ("" for none); the
        task's tokenizer encodes it.
      reward: this turn's reward.
      done: the episode ended (no observation is appended then).
      info: facts for the metrics: `tool_call` (the turn called a tool), `tool_ok`
        (the tool answered), `failed` (the runner's reason when the environment failed).
    """

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Environment(Protocol):
    """One episode's environment."""

    def reset(self, record: Any) -> list[int]:
        """Starts an episode of `record`; returns its prompt's token ids (BOS first)."""
        ...

    def step(self, turn: Turn) -> StepResult:
        """Answers a model turn."""
        ...
