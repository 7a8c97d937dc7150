"""A sampling request checked and padded on the host: one set of checks for both samplers.

`generate` and `speculative_generate` call `check_request` before anything is
traced, so a bad request gets the same error from either. Prompts are
left-padded to a bucketed length P (so new prompt lengths reuse compiled
programs); pad slots hold position -1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.rollout.sampling import SamplingConfig

__all__ = ["Request", "bucket_length", "check_request", "pad_prompts"]


def bucket_length(n: int, minimum: int = 8) -> int:
    """The padded length for n prompt tokens: the next power of two, at least `minimum`."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, bucket: bool = True,
                max_len: int | None = None, min_len: int = 0):
    """Left-pads ragged prompts; returns (tokens [B, P], positions [B, P], lengths [B]) numpy.

    With `bucket`, P is the longest prompt's `bucket_length`, capped at `max_len`
    (but never below the longest prompt). P is at least `min_len` (parts of one
    batch sampled apart share a width).
    """
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if (lengths == 0).any():
        raise ValueError(f"empty prompt at index {int(np.argmin(lengths))}: every prompt needs "
                         "at least one token (e.g. a BOS token)")
    p = int(lengths.max())
    if bucket:
        cap = bucket_length(p) if max_len is None else min(bucket_length(p), max_len)
        p = max(p, cap)
    p = max(p, min_len)
    toks = np.full((len(prompts), p), pad_id, np.int32)
    pos = np.full((len(prompts), p), -1, np.int32)
    for i, pr in enumerate(prompts):
        toks[i, p - len(pr):] = pr
        pos[i, p - len(pr):] = np.arange(len(pr))
    return toks, pos, lengths


class Request(NamedTuple):
    """A checked request on the host: B = prompts x `num_samples` rows, prompt-major.

    Row `i * num_samples + g` is sample g of prompt i.
    """

    tokens_BxP: np.ndarray  # int32 prompts, left-padded with `pad_id`
    positions_BxP: np.ndarray  # int32 0..n-1 on a prompt's tokens, -1 on padding
    lengths_B: np.ndarray  # int32 prompt lengths
    key: jax.Array  # the sampling PRNG key (a fixed one for greedy decoding without a key)


def check_request(prompts: Sequence[Sequence[int]], cfg: ModelConfig, *,
                  sampling: SamplingConfig, max_new_tokens: int, num_samples: int,
                  eos_id: int | None, pad_id: int, key: jax.Array | None,
                  draft_slots: int = 0, prompt_width: int = 0) -> Request:
    """Checks a sampling request, pads its prompts and repeats each for its samples.

    The prompt bucket is capped so that prompt slots, `max_new_tokens` and
    `draft_slots` fit the model's context (`cfg.max_position_embeddings`).

    Args:
      prompts: ragged lists of token ids, each at least one token long.
      cfg: the model (its vocabulary and context).
      sampling: greedy decoding may omit `key`; sampling needs one.
      max_new_tokens: tokens to generate at most, >= 1.
      num_samples: completions per prompt, >= 1.
      eos_id: a token id in the vocabulary, or None.
      pad_id: a token id in the vocabulary.
      key: the sampling PRNG key, or None.
      draft_slots: cache slots beyond the completion (speculative decoding's k).
      prompt_width: pad the prompts to at least this many slots (0: their bucket).

    Returns:
      A `Request`.

    Raises:
      ValueError: a count below 1, an id outside the vocabulary, no prompts or
        an empty one, a prompt that does not fit the context with the new
        tokens, or sampling without a key.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1; got {num_samples}")
    for name, tok in (("eos_id", eos_id), ("pad_id", pad_id)):
        if tok is not None and not 0 <= tok < cfg.vocab_size:
            raise ValueError(f"{name}={tok} is outside the vocabulary [0, {cfg.vocab_size})")
    ctx = cfg.max_position_embeddings
    slack = max_new_tokens + draft_slots
    toks, pos, lengths = pad_prompts(prompts, pad_id, max_len=ctx - slack, min_len=prompt_width)
    longest = int(lengths.max())
    if max(longest, prompt_width) + slack > ctx:
        drafts = f" and k={draft_slots} draft slots" if draft_slots else ""
        raise ValueError(
            f"prompt of {longest} tokens plus max_new_tokens={max_new_tokens}{drafts} exceeds "
            f"the model's context of {ctx} tokens; shorten the prompt or lower max_new_tokens")
    if bad := [int(t) for t in np.unique(np.concatenate([np.asarray(p) for p in prompts]))
               if not 0 <= t < cfg.vocab_size]:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, "
                         f"{cfg.vocab_size})")
    if num_samples > 1:
        toks, pos, lengths = (np.repeat(a, num_samples, axis=0) for a in (toks, pos, lengths))
    if key is None:
        if not sampling.greedy:
            raise ValueError("sampling needs a PRNG key (key=jax.random.key(seed))")
        key = jax.random.PRNGKey(0)
    return Request(toks, pos, lengths, key)
