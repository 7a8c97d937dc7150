"""Verifiable rewards: completion ids -> text before EOS -> a score against the gold answer.

A completion that never emitted EOS (cut off at the token limit) has no text:
`completion_text` returns None and every reward here scores None as 0.0. The
text before EOS is decoded with special tokens kept, so a stray special token
(a sampled `<pad>` or `<bos>`) breaks an exact match instead of vanishing.

GSM8K answers are compared as numbers: `extract_answer` implements the
standard extraction (the number after `####`, else the last number in the
text) and returns it normalized (`"1,234.50"` -> `"1234.5"`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np

from jaxrl_lp.models.tokenizer import Tokenizer

__all__ = ["completion_text", "completion_texts", "exact_match_reward", "extract_answer",
           "gsm8k_reward", "normalize_number", "score_completions"]


def completion_text(ids: Sequence[int], tokenizer: Tokenizer) -> str | None:
    """The decoded text of a completion before its first EOS, or None if it has no EOS.

    Args:
      ids: the completion's token ids (anything after the first EOS, e.g. padding, is ignored).
      tokenizer: the tokenizer that produced them; it must have an EOS id.

    Returns:
      The text (special tokens before EOS written out), or None when the
      completion never ended.

    Examples:
      >>> tok = CharTokenizer()
      >>> completion_text(tok.encode("81", add_eos=True) + [tok.pad_id], tok)
      '81'
      >>> completion_text(tok.encode("81"), tok) is None
      True
    """
    eos = tokenizer.eos_id
    if eos is None:
        raise ValueError("completion_text: the tokenizer has no EOS id, so a finished "
                         "completion cannot be told from a truncated one; set its eos_id")
    ids = [int(i) for i in ids]
    if eos not in ids:
        return None
    return tokenizer.decode(ids[:ids.index(eos)], skip_special=False)


def completion_texts(tokens_BxN: Any, tokenizer: Tokenizer) -> list[str | None]:
    """`completion_text` of each row of a [B, N] array (e.g. `Rollout.completion_tokens`)."""
    tokens_BxN = np.asarray(tokens_BxN)
    if tokens_BxN.ndim != 2:
        raise ValueError(f"completion_texts: expected a [B, N] array, got shape "
                         f"{tokens_BxN.shape}")
    return [completion_text(row, tokenizer) for row in tokens_BxN]


_INTEGER_RE = re.compile(r"-?\d+")


def exact_match_reward(text: str | None, answer: str, *, format_reward: float = 0.0) -> float:
    """1.0 if the completion's text is exactly `answer`, else 0.0 (or `format_reward`).

    Args:
      text: the completion's text before EOS (`completion_text`); None if it never ended.
      answer: the gold answer text, e.g. "81".
      format_reward: partial credit for a wrong answer that is still a well-formed
        integer ended by EOS; 0.0 (the default) means pure exact-match.

    Returns:
      The reward as a Python float.

    Examples:
      >>> exact_match_reward("81", "81"), exact_match_reward("81 ", "81"), exact_match_reward(None, "81")
      (1.0, 0.0, 0.0)
    """
    if text is None:
        return 0.0
    if text == answer:
        return 1.0
    if format_reward and _INTEGER_RE.fullmatch(text):
        return float(format_reward)
    return 0.0


# A number: an optional sign (before or after a dollar sign), digits with
# optional thousands commas ("1,234" but not the list "1,2,3"), an optional
# decimal part. "5." matches "5": a sentence's full stop is not a decimal point.
_NUMBER = r"(-?)(?:\$\s?)?(-?)((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(_NUMBER)
_HASH_ANSWER_RE = re.compile(r"####\s*" + _NUMBER)


def normalize_number(text: str) -> str | None:
    """A canonical string for a number: no commas, $, leading zeros or trailing decimal zeros.

    Args:
      text: e.g. "$1,234.50", "-007", "3.0".

    Returns:
      e.g. "1234.5", "-7", "3"; None if `text` is not a number.
    """
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def _join(match: re.Match) -> str | None:
    sign = "-" if (match.group(1) or match.group(2)) else ""
    return normalize_number(sign + match.group(3))


def extract_answer(text: str | None) -> str | None:
    """The standard GSM8K answer extraction, normalized.

    The number after the first `####`; if there is none, the last number in the
    text. Commas, `$` and a trailing full stop are dropped; signs and decimals kept.

    Args:
      text: a GSM8K answer or a model completion; None passes through.

    Returns:
      The normalized number as a string (see `normalize_number`), or None.

    Examples:
      >>> extract_answer("so 2 * 617 = 1234\\n#### 1,234"), extract_answer("The answer is $5.")
      ('1234', '5')
    """
    if text is None:
        return None
    match = _HASH_ANSWER_RE.search(text)
    if match is None:
        numbers = list(_NUMBER_RE.finditer(text))
        if not numbers:
            return None
        match = numbers[-1]
    return _join(match)


def gsm8k_reward(text: str | None, gold_answer_text: str) -> float:
    """1.0 if the completion's extracted answer equals the gold `#### answer` numerically.

    Args:
      text: the completion's text before EOS; None (never ended) scores 0.0.
      gold_answer_text: the dataset's `answer` field (reasoning then `#### final`).

    Returns:
      1.0 or 0.0.

    Examples:
      >>> gsm8k_reward("12 + 30 = 42. #### 42", "6 * 7 = 42\\n#### 42")
      1.0
    """
    gold = extract_answer(gold_answer_text)
    if gold is None:
        raise ValueError(f"gsm8k_reward: no number in the gold answer {gold_answer_text[-80:]!r}; "
                         "GSM8K answers end with '#### <number>'")
    got = extract_answer(text)
    return 1.0 if got is not None and Decimal(got) == Decimal(gold) else 0.0


def score_completions(tokens_BxN: Any, records: Sequence[Any], tokenizer: Tokenizer,
                      reward_fn: Callable[[str | None, Any], float]) -> np.ndarray:
    """Rewards of a batch of completions: `reward_fn(completion_text(row), record)` per row.

    Args:
      tokens_BxN: [B, N] completion ids (e.g. `Rollout.completion_tokens`).
      records: B records, row b's problem (repeat each prompt's record G times for groups).
      tokenizer: the tokenizer that produced the ids.
      reward_fn: (text or None, record) -> float, e.g. `task.reward`.

    Returns:
      [B] float32 rewards.
    """
    texts = completion_texts(tokens_BxN, tokenizer)
    if len(texts) != len(records):
        raise ValueError(f"score_completions: {len(texts)} completions but {len(records)} "
                         "records; pass one record per completion row")
    return np.asarray([reward_fn(t, r) for t, r in zip(texts, records, strict=True)],
                      np.float32)
