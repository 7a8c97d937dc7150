"""GSM8K-format data: local JSONL or parquet with `question` and `answer` ("... #### 42").

`load_gsm8k` reads the file eagerly and checks every record, naming the file
and the line (JSONL) or row (parquet) of the first bad one. `GSM8KTask` gives
a loaded dataset the same interface as `ArithmeticTask` (splits, `prompt_ids`,
`sft_example`, `reward`, `rewards`), scoring with the standard answer extraction.
Nothing is downloaded: point it at a local copy (e.g. `openai/grade-school-math`
`train.jsonl` or the Hugging Face `gsm8k` parquet files).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_lp.data.pipeline import in_heldout
from jaxrl_lp.data.rewards import gsm8k_reward, score_completions
from jaxrl_lp.models.tokenizer import Tokenizer

__all__ = ["GSM8KTask", "load_gsm8k"]

_KEYS = ("question", "answer")
_JSONL_SUFFIXES = (".jsonl", ".json")
_PARQUET_SUFFIXES = (".parquet",)


def _check_record(obj: Any, where: str) -> dict[str, str]:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with keys 'question' and 'answer', "
                         f"got {type(obj).__name__}")
    for key in _KEYS:
        if key not in obj:
            raise ValueError(f"{where}: missing key {key!r} (keys present: {sorted(obj)}); "
                             "each record needs 'question' and 'answer'")
        if not isinstance(obj[key], str):
            raise ValueError(f"{where}: {key!r} must be a string, got {type(obj[key]).__name__}")
    return {key: obj[key] for key in _KEYS}


def _read_jsonl(path: str) -> list[dict[str, str]]:
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) carry no record
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {lineno}: invalid JSON ({e.msg} at column "
                                 f"{e.colno}); write one JSON object per line") from None
            records.append(_check_record(obj, f"{path}: line {lineno}"))
    return records


def _read_parquet(path: str) -> list[dict[str, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow "
                          "(or convert the file to JSONL)") from None
    table = pq.read_table(path)
    missing = [k for k in _KEYS if k not in table.column_names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing} (columns present: "
                         f"{table.column_names}); the file needs 'question' and 'answer'")
    rows = table.select(list(_KEYS)).to_pylist()
    return [_check_record(row, f"{path}: row {i}") for i, row in enumerate(rows, start=1)]


def load_gsm8k(path: str | os.PathLike) -> list[dict[str, str]]:
    """Loads GSM8K-format records from a local `.jsonl` (or line-delimited `.json`) or `.parquet`.

    Args:
      path: the file. Each record needs string fields `question` and `answer`
        (the answer ends with `#### <number>`); other fields are dropped.

    Returns:
      A list of `{"question": ..., "answer": ...}` dicts, in file order.

    Raises:
      FileNotFoundError: no such file.
      ValueError: an unsupported extension, an empty file, or a bad record
        (the message names the file and the 1-based line or row).

    Examples:
      >>> records = load_gsm8k("data/gsm8k/train.jsonl")
      >>> extract_answer(records[0]["answer"])
      '72'
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        what = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
        raise FileNotFoundError(f"GSM8K file {path!r} {what}; pass a local .jsonl or .parquet "
                                "file with 'question' and 'answer' fields")
    suffix = os.path.splitext(path)[1].lower()
    if suffix in _JSONL_SUFFIXES:
        records = _read_jsonl(path)
    elif suffix in _PARQUET_SUFFIXES:
        records = _read_parquet(path)
    else:
        raise ValueError(f"{path}: unsupported extension {suffix!r}; use "
                         f"{', '.join(_JSONL_SUFFIXES + _PARQUET_SUFFIXES)}")
    if not records:
        raise ValueError(f"{path}: no examples in the file; it needs at least one record with "
                         "'question' and 'answer'")
    return records


# eq=False: comparing or hashing tasks would walk every record.
@dataclasses.dataclass(frozen=True, eq=False)
class GSM8KTask:
    """GSM8K-format records behind the task interface: splits, tokenization and reward.

    Prompts are `prompt_template` filled with the question, after BOS when the
    tokenizer has one; SFT completions are " " + the reference answer + EOS.

    Args:
      records: the training records (`load_gsm8k`).
      tokenizer: a `Tokenizer` with an EOS id (e.g. `HFTokenizer.from_file(...)`).
      heldout_records: evaluation records (e.g. the test file); None holds out a
        hash-chosen `heldout_fraction` of `records` instead.
      heldout_fraction: used only when `heldout_records` is None.
      prompt_template: a format string with a `{question}` field.

    Examples:
      >>> task = GSM8KTask(load_gsm8k("train.jsonl"), HFTokenizer.from_file("ckpt"),
      ...                  heldout_records=load_gsm8k("test.jsonl"))
      >>> task.reward("... #### 72", task.train[0])  # 1.0 if the gold answer is 72
    """

    records: Sequence[dict[str, str]]
    tokenizer: Tokenizer
    heldout_records: Sequence[dict[str, str]] | None = None
    heldout_fraction: float = 0.1
    prompt_template: str = "Question: {question}\nAnswer:"

    def __post_init__(self):
        if self.tokenizer.eos_id is None:
            raise ValueError("GSM8KTask: the tokenizer needs an EOS id; pass eos_id= to "
                             "HFTokenizer.from_file")
        if "{question}" not in self.prompt_template:
            raise ValueError(f"GSM8KTask: prompt_template={self.prompt_template!r} needs a "
                             "'{question}' field")
        if self.heldout_records is None and not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"GSM8KTask: heldout_fraction={self.heldout_fraction} must be in "
                             "(0, 1)")

    def _split(self, heldout: bool) -> list[dict[str, str]]:
        if self.heldout_records is not None:
            return list(self.heldout_records if heldout else self.records)
        split = [r for r in self.records
                 if in_heldout(r["question"], self.heldout_fraction) == heldout]
        if not split:
            raise ValueError(f"GSM8KTask: the {'heldout' if heldout else 'train'} split of "
                             f"{len(self.records)} records is empty; pass heldout_records or "
                             "more records")
        return split

    @functools.cached_property
    def train(self) -> list[dict[str, str]]:
        """The training records."""
        return self._split(heldout=False)

    @functools.cached_property
    def heldout(self) -> list[dict[str, str]]:
        """The evaluation records."""
        return self._split(heldout=True)

    @functools.cached_property
    def _lengths(self) -> tuple[int, int]:
        """(longest prompt, longest SFT completion) in tokens over every record."""
        records = [*self.records, *(self.heldout_records or ())]
        prompt = max(len(self.prompt_ids(r)) for r in records)
        answer = max(len(self.sft_example(r)[1]) for r in records)
        return prompt, answer

    @property
    def max_completion_tokens(self) -> int:
        """The longest reference completion in tokens, EOS included: the default budget
        of a sampled completion (`grpo.max_new_tokens` overrides it)."""
        return self._lengths[1]

    @property
    def max_sequence_length(self) -> int:
        """The longest prompt plus the longest completion, in tokens: the SFT `seq_len`."""
        return sum(self._lengths)

    def prompt_ids(self, record: dict[str, str]) -> list[int]:
        """BOS (if any) then the filled prompt template."""
        text = self.prompt_template.format(question=record["question"])
        return self.tokenizer.encode(text, add_bos=self.tokenizer.bos_id is not None)

    def sft_example(self, record: dict[str, str]) -> tuple[list[int], list[int]]:
        """(prompt_ids, completion_ids): the prompt, and " " + reference answer + EOS."""
        return (self.prompt_ids(record),
                self.tokenizer.encode(" " + record["answer"], add_eos=True))

    def reward(self, completion_text: str | None, record: dict[str, str]) -> float:
        """`gsm8k_reward` of a completion's text before EOS (None: it never ended)."""
        return gsm8k_reward(completion_text, record["answer"])

    def rewards(self, completion_tokens_BxN: Any,
                records: Sequence[dict[str, str]]) -> np.ndarray:
        """[B] float32 rewards of a batch of completion ids (row b answers `records[b]`)."""
        return score_completions(completion_tokens_BxN, records, self.tokenizer, self.reward)
