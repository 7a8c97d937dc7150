"""A user's records as a task: prompts rendered by the checkpoint's chat template, completions
scored by reward functions (`task.kind=dataset`, or built in Python).

`DatasetTask` reads a record's prompt from `prompt_key` (a string, or a chat `messages`
list), its reference answer from `answer_key` and its warm-start completion from
`completion_key` (default: the answer). Prompts are rendered by a chat template
(`tasks.ChatTemplate`: the checkpoint's own, with a system prompt and the template's
options) or, for a checkpoint without one or a model trained from scratch, the plain
format (`tasks.PlainFormat`: the prompt's text after BOS). Completions are scored by
reward functions with TRL's signature (`tasks.RewardScorer`): the prompts, the
completions' text before EOS (special tokens skipped) and their ids, the answer as
`answer`, and every other column of the records as a keyword.

`EnvDatasetTask` adds an environment per episode (a user's factory, or `tasks.ToolEnv`
over tool functions): multi-turn episodes whose observations are text, or chat messages
rendered by the template (a tool result as a tool message), token in and token out. The
reward functions, when given, score an episode's whole completion when it ends, added
to the environment's rewards.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_lp.data.pipeline import in_heldout
from jaxrl_lp.envs.base import StepResult, Turn
from jaxrl_lp.models.tokenizer import CharTokenizer, Tokenizer
from jaxrl_lp.tasks.chat import ChatTemplate, PlainFormat, as_messages
from jaxrl_lp.tasks.records import check_prompts, prompt_key_text
from jaxrl_lp.tasks.rewards import RewardBatch, RewardFunction, RewardScorer, parse_rewards

__all__ = ["DatasetTask", "EnvDatasetTask", "char_tokenizer_for", "completion_texts_of",
           "trimmed_ids_of"]


def char_tokenizer_for(texts: Sequence[str]) -> CharTokenizer:
    """A `CharTokenizer` whose alphabet is the default one and then every other character of
    `texts`, in code-point order (the same texts give the same ids)."""
    base = CharTokenizer().alphabet
    extra = sorted({c for t in texts for c in t} - set(base))
    return CharTokenizer(base + "".join(extra))


def completion_texts_of(tokens_BxN: Any, tokenizer: Tokenizer) -> list[str]:
    """Each row's text before its first EOS (all of it when it has none), special tokens
    skipped: what TRL hands its reward functions."""
    eos, out = tokenizer.eos_id, []
    for row in np.asarray(tokens_BxN):
        ids = [int(i) for i in row]
        out.append(tokenizer.decode(ids[:ids.index(eos)] if eos in ids else ids))
    return out


def trimmed_ids_of(tokens_BxN: Any, tokenizer: Tokenizer) -> list[list[int]]:
    """Each row's ids up to and including its first EOS (padding dropped)."""
    eos, out = tokenizer.eos_id, []
    for row in np.asarray(tokens_BxN):
        ids = [int(i) for i in row]
        out.append(ids[:ids.index(eos) + 1] if eos in ids else ids)
    return out


# eq=False: comparing or hashing tasks would walk every record.
@dataclasses.dataclass(frozen=True, eq=False)
class DatasetTask:
    """Records with prompts and reference answers, scored by reward functions (module docstring).

    Args:
      records: the training records (dicts), e.g. `load_records(path)["train"]`.
      tokenizer: a `models.Tokenizer` with an EOS and a padding id.
      reward_functions: the `RewardFunction`s (`parse_rewards("exact_match,mymod:fn=0.5")`);
        empty: `exact_match`.
      heldout_records: evaluation records; None holds out a hash-chosen `heldout_fraction`
        of `records` (by the prompt's text, so a record's split never depends on a seed).
      prompt_key: the column of the prompts (a string, or a list of chat messages).
      answer_key: the column of the reference answers ('' for none); the reward
        functions get it as `answer` too.
      completion_key: the column the warm-start learns from ('': `answer_key`).
      template: a `ChatTemplate` (the checkpoint's), or None for the plain format.
      system_prompt: a system message put before each prompt ('' for none).
      template_options: the template's variables (e.g. `{"enable_thinking": False}`).
      heldout_fraction: the share held out when `heldout_records` is None.
      reward_timeout_s: seconds a reward function may take on a batch.
      failure_reward: a sample's value from a reward function that failed on it.
      completion_budget: the completion budget when the records have no reference
        completions (no answer or completion column): `max_completion_tokens`.

    Examples:
      >>> records = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(30)
      ...            for b in range(30)]
      >>> task = DatasetTask(records, char_tokenizer_for([r["prompt"] for r in records]))
      >>> task.rewards(np.asarray([task.sft_example(task.train[0])[1]]), task.train[:1]).total_B
      array([1.], dtype=float32)
    """

    records: Sequence[dict]
    tokenizer: Tokenizer
    reward_functions: Sequence[RewardFunction] = ()
    heldout_records: Sequence[dict] | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    completion_key: str = ""
    template: ChatTemplate | None = None
    system_prompt: str = ""
    template_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    heldout_fraction: float = 0.1
    reward_timeout_s: float = 60.0
    failure_reward: float = 0.0
    completion_budget: int = 0

    def __post_init__(self):
        tok = self.tokenizer
        if tok.eos_id is None or tok.pad_id is None:
            raise ValueError("DatasetTask: the tokenizer needs an EOS and a padding id (got "
                             f"eos_id={tok.eos_id}, pad_id={tok.pad_id})")
        if not self.records:
            raise ValueError("DatasetTask: no records")
        check_prompts(self.records, self.prompt_key, "the records")
        if self.heldout_records is not None:
            if not self.heldout_records:
                raise ValueError("DatasetTask: heldout_records is empty; pass records or None")
            check_prompts(self.heldout_records, self.prompt_key, "the held-out records")
        elif not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"DatasetTask: heldout_fraction={self.heldout_fraction} must be in "
                             "(0, 1)")
        for key in (self.answer_key, self.completion_key):
            if key and key not in self.records[0]:
                raise ValueError(f"DatasetTask: the records have no column {key!r} (columns: "
                                 f"{sorted(self.records[0])})")
        if not self.reward_functions:
            object.__setattr__(self, "reward_functions", parse_rewards(self._default_rewards))
        object.__setattr__(self, "reward_functions", tuple(self.reward_functions))
        object.__setattr__(self, "template_options", dict(self.template_options))
        if self._completion_column is None and self.completion_budget < 1:
            raise ValueError("DatasetTask: the records have no reference completions "
                             "(answer_key and completion_key are ''): pass completion_budget "
                             "(grpo.max_new_tokens) to size the completions")

    _default_rewards = "exact_match"

    @property
    def _completion_column(self) -> str | None:
        return self.completion_key or self.answer_key or None

    @property
    def _format(self) -> ChatTemplate | PlainFormat:
        return self.template if self.template is not None else PlainFormat()

    def _split(self, heldout: bool) -> list[dict]:
        if self.heldout_records is not None:
            return list(self.heldout_records if heldout else self.records)
        split = [r for r in self.records
                 if in_heldout(prompt_key_text(r[self.prompt_key]), self.heldout_fraction)
                 == heldout]
        if not split:
            raise ValueError(f"DatasetTask: the {'heldout' if heldout else 'train'} split of "
                             f"{len(self.records)} records is empty; pass heldout_records, more "
                             "records or another heldout_fraction")
        return split

    @functools.cached_property
    def train(self) -> list[dict]:
        """The training records."""
        return self._split(heldout=False)

    @functools.cached_property
    def heldout(self) -> list[dict]:
        """The evaluation records."""
        return self._split(heldout=True)

    def messages(self, record: dict) -> list[dict]:
        """The record's prompt as chat messages, the system prompt first when given."""
        return as_messages(record[self.prompt_key], self.system_prompt or None)

    def _tools(self) -> Any:
        return None

    def prompt_ids(self, record: dict) -> list[int]:
        """The prompt's tokens: the chat template's rendering with its generation prompt, or
        (plain format) BOS, when the tokenizer has one, then the prompt's text."""
        return list(self._format.prompt_ids(self.messages(record), self.tokenizer,
                                            tools=self._tools(), **self.template_options))

    def completion_text(self, record: dict) -> str:
        """The reference completion the warm-start learns (`completion_key`, else the answer)."""
        column = self._completion_column
        if column is None:
            raise ValueError("DatasetTask: the records have no reference completions "
                             "(answer_key and completion_key are ''); set sft.steps=0")
        return str(record[column])

    def sft_example(self, record: dict) -> tuple[list[int], list[int]]:
        """(prompt_ids, completion_ids): the prompt, and the reference completion then EOS."""
        return (self.prompt_ids(record),
                self.tokenizer.encode(self.completion_text(record), add_eos=True))

    @functools.cached_property
    def _lengths(self) -> tuple[int, int]:
        """(longest prompt, longest reference completion) in tokens over every record."""
        records = [*self.records, *(self.heldout_records or ())]
        prompt = max(len(self.prompt_ids(r)) for r in records)
        if self._completion_column is None:
            return prompt, self.completion_budget
        return prompt, max(len(self.tokenizer.encode(self.completion_text(r))) + 1
                           for r in records)

    @property
    def max_completion_tokens(self) -> int:
        """The longest reference completion in tokens, EOS included (without reference
        completions: `completion_budget`)."""
        return self._lengths[1]

    @property
    def max_sequence_length(self) -> int:
        """The longest prompt plus the longest completion: the warm-start's `seq_len`."""
        return sum(self._lengths)

    @functools.cached_property
    def scorer(self) -> RewardScorer:
        """The reward functions on host threads, each call bounded by `reward_timeout_s`."""
        return RewardScorer(self.reward_functions, timeout_s=self.reward_timeout_s,
                            failure_reward=self.failure_reward)

    def _columns(self, records: Sequence[dict]) -> dict[str, list]:
        """Every column but the prompt's, one list each; the answer also as `answer`."""
        names = [k for k in records[0] if k != self.prompt_key]
        columns = {k: [r.get(k) for r in records] for k in names}
        if self.answer_key and "answer" not in columns:
            columns["answer"] = [r[self.answer_key] for r in records]
        return columns

    def score_texts(self, records: Sequence[dict], texts: Sequence[str],
                    ids: Sequence[Sequence[int]], *, strict: bool = False) -> RewardBatch:
        """The reward functions on completions given as text (row b answers `records[b]`);
        `strict`: a failure raises (the start probe) instead of being the sample's
        `failure_reward`."""
        prompts = [r[self.prompt_key] for r in records]
        conversational = [not isinstance(p, str) for p in prompts]
        completions = [[{"role": "assistant", "content": t}] if c else t
                       for t, c in zip(texts, conversational, strict=True)]
        describe = lambda i: f"record {prompt_key_text(prompts[i])[:60]!r}"
        return self.scorer.score(prompts, completions, [list(map(int, x)) for x in ids],
                                 self._columns(records), strict=strict, describe=describe)

    def rewards(self, completion_tokens_BxN: Any, records: Sequence[dict]) -> RewardBatch:
        """The reward functions' weighted sum for a batch of completion ids (row b answers
        `records[b]`), with each function's values (`RewardBatch`)."""
        return self.score_texts(records, completion_texts_of(completion_tokens_BxN, self.tokenizer),
                                trimmed_ids_of(completion_tokens_BxN, self.tokenizer))

    def fingerprint_extra(self) -> dict:
        """What identifies the task beyond its prompts: the reward functions and weights, the
        keys, the template's source and options (`tasks.task_fingerprint`)."""
        source = getattr(self.template, "source", "")
        return {"rewards": [[f.name, f.weight] for f in self.reward_functions],
                "keys": [self.prompt_key, self.answer_key, self.completion_key],
                "template": hashlib.blake2b(source.encode(), digest_size=8).hexdigest(),
                "system": self.system_prompt, "options": sorted(self.template_options.items())}


class _Episode:
    """One episode of an `EnvDatasetTask`: the user's environment, with the prompt the task
    renders and the reward functions scoring the episode's text when it ends."""

    def __init__(self, task: EnvDatasetTask, env: Any):
        self.task, self.env, self.record = task, env, None
        self.texts: list[str] = []
        self.turns = 0
        self.ids: list[int] = []

    def reset(self, record: dict) -> list[int]:
        self.record, self.texts, self.ids, self.turns = record, [], [], 0
        reset = getattr(self.env, "reset", None)
        prompt = reset(record) if callable(reset) else None
        if prompt is None:
            return self.task.prompt_ids(record)
        override = {**record, self.task.prompt_key: prompt}
        return self.task.prompt_ids(override)

    def step(self, turn: Turn) -> StepResult:
        # The environment reads the turn with its special tokens written out (`<tool_call>`
        # is one in some tokenizers); the reward functions read it as TRL decodes, without.
        shown = Turn(turn.tokens, self.task.tokenizer.decode(list(turn.tokens),
                                                             skip_special=False), turn.ended_by)
        result = self.env.step(shown)
        if not isinstance(result, StepResult):
            raise TypeError(f"{type(self.env).__name__}.step returned "
                            f"{type(result).__name__}, not an envs.StepResult")
        self.texts.append(turn.text)
        self.ids += list(turn.tokens)
        self.turns += 1
        if not result.done and self.turns == self.task.max_turns and self.task.reward_functions:
            # The turn limit's turn: the episode ends here, so the reward functions score it
            # (the sampler would end it with reason max_turns, unscored).
            result = dataclasses.replace(result, observation="", messages=(), done=True,
                                         info={**result.info, "turn_limit": True})
        if not result.done:
            self.texts.append(result.observation or "".join(
                str(m.get("content", "")) for m in result.messages))
            return result
        if not self.task.reward_functions:
            return result
        batch = self.task.score_texts([self.record], ["".join(self.texts)], [self.ids])
        parts = {name: float(v[0]) for name, v in batch.parts.items()}
        return dataclasses.replace(result, reward=result.reward + float(batch.total_B[0]),
                                   info={**result.info, "reward_parts": parts,
                                         "reward_failed": dict(batch.failed)})


@dataclasses.dataclass(frozen=True, eq=False)
class EnvDatasetTask(DatasetTask):
    """A `DatasetTask` whose episodes run with an environment (module docstring).

    Args (besides `DatasetTask`'s):
      env_factory: makes one environment per episode: an object with `step(turn) ->
        envs.StepResult` and optionally `reset(record)` (returning None: the record's
        prompt; or a prompt, a string or messages, of its own).
      max_turns: model turns per episode at most.
      max_turn_tokens: tokens of one model turn at most.
      max_observation_tokens: tokens of one observation at most.
      stop: strings that end a model turn besides EOS, each one token of the tokenizer
        (a tool call's end, `</tool_call>`).
      tools: tool schemas the chat template is rendered with (`tasks.tool_schema`), or ().

    The reward functions are optional here: none (the default) leaves the environment's
    rewards alone.
    """

    env_factory: Callable[[], Any] | None = None
    max_turns: int = 3
    max_turn_tokens: int = 128
    max_observation_tokens: int = 128
    stop: Sequence[str] = ()
    tools: Sequence[Mapping] = ()

    _default_rewards = ""

    def __post_init__(self):
        if not callable(self.env_factory):
            raise ValueError(f"EnvDatasetTask: env_factory={self.env_factory!r} must make an "
                             "environment (a callable with no arguments)")
        for name in ("max_turns", "max_turn_tokens", "max_observation_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"EnvDatasetTask: {name}={v!r} must be an int >= 1")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "tools", tuple(self.tools))
        super().__post_init__()  # no reward functions: `_default_rewards` is none here
        self.stop_token_ids  # noqa: B018 - each stop string must be one token: checked here

    def _tools(self) -> Any:
        return list(self.tools) or None

    @functools.cached_property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The token of each stop string."""
        ids = []
        for s in self.stop:
            enc = self.tokenizer.encode(s)
            if len(enc) != 1:
                raise ValueError(f"EnvDatasetTask: stop string {s!r} is {len(enc)} tokens of the "
                                 "tokenizer; a turn ends on one token: give a string that is a "
                                 "single token (a special token such as </tool_call>)")
            ids.append(enc[0])
        return tuple(ids)

    def make_env(self) -> _Episode:
        """A fresh episode: the user's environment behind the task's prompt and rewards."""
        return _Episode(self, self.env_factory())

    def observation_ids(self, result: StepResult, ended_by: str) -> list[int]:
        """An observation's tokens: chat messages rendered by the template where the
        environment answered with messages (a tool message), else its text encoded."""
        if result.messages:
            text = self._format.observation_text(list(result.messages), ended_by=ended_by,
                                                 tools=self._tools(), **self.template_options)
        else:
            text = result.observation
        return self.tokenizer.encode(text) if text else []

    def fingerprint_extra(self) -> dict:
        """`DatasetTask`'s, with the episode's limits, stop strings and tools."""
        return {**super().fingerprint_extra(), "stop": list(self.stop),
                "tools": [dict(t) for t in self.tools],
                "env": getattr(self.env_factory, "__qualname__", repr(self.env_factory))}
