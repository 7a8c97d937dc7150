"""grain pipelines: checkpointable prompt batches for GRPO, padded (tokens, loss mask) for SFT.

Both loaders are `grain.MapDataset` chains `source -> shuffle(seed) -> repeat
-> batch`, handed out as a `grain.IterDataset`, so an iterator is a pure
function of (records, seed, batch size, position). `it.get_state()` is a
small dict of ints (`{"next_index": k}`); `it.set_state(state)` on a fresh
iterator over the same records and settings resumes with exactly the batches
the original would have produced next. Save it with the rest of a checkpoint.

Held-out splits are decided by `in_heldout`, a stable hash of a record's key
text, so a record's split never depends on a seed, a process or a file order.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import grain
import numpy as np

__all__ = ["IndexedSplit", "SFTBatch", "hash_fraction", "in_heldout", "prompt_loader", "sft_batch",
           "sft_loader"]


def hash_fraction(key: str) -> float:
    """A stable pseudo-random number in [0, 1) from a string (blake2b, not Python's `hash`).

    Args:
      key: any text, e.g. a problem's prompt.

    Returns:
      The first 8 bytes of the blake2b digest of `key` (UTF-8) over 2**64.

    Examples:
      >>> 0.0 <= hash_fraction("23+58=") < 1.0
      True
    """
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


class IndexedSplit(Sequence):
    """A split read by index, as a list is (ints, negative ints, slices): a subclass sets
    `_size` and returns item i in `_item(i)`, for 0 <= i < `_size`."""

    _size: int

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._size))]
        i = int(i)
        if i < 0:
            i += self._size
        if not 0 <= i < self._size:
            raise IndexError(f"{type(self).__name__} index {i} out of range [0, {self._size})")
        return self._item(i)

    def _item(self, i: int) -> Any:
        raise NotImplementedError


def in_heldout(key: str, heldout_fraction: float) -> bool:
    """Whether the record keyed by `key` belongs to the held-out split.

    Args:
      key: the record's identifying text (the same text always lands in the same split).
      heldout_fraction: expected fraction of records held out, in [0, 1).

    Returns:
      `hash_fraction(key) < heldout_fraction`.
    """
    return hash_fraction(key) < heldout_fraction


def _check_loader_args(name: str, records: Sequence[Any], batch_size: int,
                       num_epochs: int | None) -> None:
    if len(records) == 0:
        raise ValueError(f"{name}: no records to load; pass a non-empty split")
    if batch_size <= 0:
        raise ValueError(f"{name}: batch_size must be positive, got {batch_size}")
    if num_epochs is not None and num_epochs <= 0:
        raise ValueError(f"{name}: num_epochs must be positive or None (repeat forever), "
                         f"got {num_epochs}")


# Reading is synchronous by default: a batch of generated problems costs about
# a millisecond, far below a training step, and grain's default prefetch (16
# threads, 500 elements) would only contend with the step for the GIL.
_SYNCHRONOUS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def _dataset(records: Sequence[Any], seed: int, shuffle: bool,
             num_epochs: int | None, shard: tuple[int, int] = (0, 1)) -> grain.MapDataset:
    ds = grain.MapDataset.source(records)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    # repeat() after shuffle reshuffles each epoch with a seed derived from `seed`.
    ds = ds.repeat(num_epochs)
    index, count = shard
    if not (isinstance(index, int) and isinstance(count, int) and 0 <= index < count):
        raise ValueError(f"shard={shard!r} must be (index, count) with 0 <= index < count")
    # Data shard `index` of `count` reads every count-th element of the shuffled stream,
    # so the shards' batch k together hold exactly the records of the unsharded batch k.
    return ds if count == 1 else ds[index::count]


def prompt_loader(records: Sequence[Any], batch_size: int, seed: int, shuffle: bool = True,
                  num_epochs: int | None = None, *, drop_remainder: bool = False,
                  read_options: grain.ReadOptions | None = None,
                  shard: tuple[int, int] = (0, 1)) -> grain.IterDataset:
    """Batches of problem records, shuffled per epoch, with a checkpointable iterator.

    Args:
      records: a random-access sequence of records (`len` and integer indexing),
        e.g. `ArithmeticTask.train` or the list from `load_gsm8k`.
      batch_size: records per batch.
      seed: shuffle seed; epoch e is shuffled with a seed derived from it.
      shuffle: False keeps the records' order (e.g. for evaluation).
      num_epochs: passes over the records; None repeats forever.
      drop_remainder: drop a last batch smaller than `batch_size` (finite epochs only).
      read_options: grain prefetching; None reads synchronously in the caller's thread.
      shard: `(index, count)`: read data shard `index` of `count` (every count-th
        record of the shuffled stream; `batch_size` is then the shard's share).

    Returns:
      A `grain.IterDataset` whose elements are lists of `batch_size` records.
      `iter(...)` gives a `grain.DatasetIterator` with `get_state()` / `set_state()`.

    Examples:
      >>> it = iter(prompt_loader(list(range(10)), batch_size=4, seed=0))
      >>> first = next(it); state = it.get_state(); second = next(it)
      >>> it2 = iter(prompt_loader(list(range(10)), batch_size=4, seed=0))
      >>> it2.set_state(state); next(it2) == second
      True
    """
    _check_loader_args("prompt_loader", records, batch_size, num_epochs)
    ds = _dataset(records, seed, shuffle, num_epochs, shard)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=list)
    return ds.to_iter_dataset(read_options or _SYNCHRONOUS)


# What a task's `sft_example` returns: (prompt_ids, completion_ids), or with a third
# element, the completion's per-token loss mask (a multi-turn episode's observations 0).
SFTExample = (tuple[Sequence[int], Sequence[int]]
              | tuple[Sequence[int], Sequence[int], Sequence[float]])


class SFTBatch(NamedTuple):
    """A padded supervised batch; letters: B batch, L sequence length.

    The loss at position t predicts `tokens_BxL[:, t]` from the logits at t-1,
    weighted by `loss_mask_BxL[:, t]`: i.e. targets `tokens_BxL[:, 1:]` with
    weights `loss_mask_BxL[:, 1:]`. Column 0 of the mask is always 0.

    Attributes:
      tokens_BxL: int32, prompt then completion, right-padded with `pad_id`.
      loss_mask_BxL: float32, 1.0 exactly where the token is a completion token.
    """

    tokens_BxL: np.ndarray
    loss_mask_BxL: np.ndarray


def sft_batch(examples: Sequence[SFTExample], pad_id: int,
              seq_len: int | None = None) -> SFTBatch:
    """Pads (prompt_ids, completion_ids[, completion_mask]) examples into an `SFTBatch`.

    Args:
      examples: as returned by a task's `sft_example`; every prompt needs at least
        one token (its BOS) so every completion token has a predecessor. A
        multi-turn task's examples carry a third element, the completion's loss
        mask, one value per completion token (0 on an environment's observations,
        `envs.CalculatorTask`); a pair's completion is all in the loss, as before.
      pad_id: the tokenizer's padding id.
      seq_len: the padded length L; None uses the longest example. Pass a fixed
        value in training so every step has one shape (no recompiles).

    Returns:
      The `SFTBatch` (numpy arrays).

    Examples:
      >>> b = sft_batch([([1, 5, 6], [7, 2])], pad_id=0, seq_len=6)
      >>> b.tokens_BxL.tolist(), b.loss_mask_BxL.tolist()
      ([[1, 5, 6, 7, 2, 0]], [[0.0, 0.0, 0.0, 1.0, 1.0, 0.0]])
      >>> sft_batch([([1], [7, 8, 2], [1.0, 0.0, 1.0])], pad_id=0).loss_mask_BxL.tolist()
      [[0.0, 1.0, 0.0, 1.0]]
    """
    if len(examples) == 0:
        raise ValueError("sft_batch: no examples given")
    lengths = [len(e[0]) + len(e[1]) for e in examples]
    for i, (prompt, completion, *weights) in enumerate(examples):
        if weights and len(weights[0]) != len(completion):
            raise ValueError(f"sft_batch: example {i} has {len(completion)} completion tokens "
                             f"and a loss mask of {len(weights[0])}; give one per token")
        if len(prompt) == 0:
            raise ValueError(f"sft_batch: example {i} has an empty prompt; start prompts with "
                             "a BOS token")
        if len(completion) == 0:
            raise ValueError(f"sft_batch: example {i} has an empty completion; nothing to learn")
    longest = max(lengths)
    if seq_len is None:
        seq_len = longest
    elif longest > seq_len:
        i = lengths.index(longest)
        raise ValueError(f"sft_batch: example {i} has {longest} tokens, more than "
                         f"seq_len={seq_len}; raise seq_len to at least {longest}")
    tokens = np.full((len(examples), seq_len), pad_id, np.int32)
    mask = np.zeros((len(examples), seq_len), np.float32)
    for i, (prompt, completion, *weights) in enumerate(examples):
        p, n = len(prompt), len(completion)
        tokens[i, :p] = prompt
        tokens[i, p:p + n] = completion
        mask[i, p:p + n] = weights[0] if weights else 1.0
    return SFTBatch(tokens, mask)


def _batch_examples(examples: Sequence[SFTExample], pad_id: int,
                    seq_len: int | None) -> SFTBatch:
    return sft_batch(examples, pad_id, seq_len)


def sft_loader(records: Sequence[Any], example_fn: Callable[[Any], SFTExample],
               batch_size: int, seed: int, pad_id: int, seq_len: int | None = None, *,
               shuffle: bool = True, num_epochs: int | None = None,
               read_options: grain.ReadOptions | None = None,
               shard: tuple[int, int] = (0, 1)) -> grain.IterDataset:
    """Shuffled `SFTBatch`es of `example_fn(record)`, with a checkpointable iterator.

    Args:
      records: random-access records, e.g. `task.train`.
      example_fn: record -> (prompt_ids, completion_ids) or (prompt_ids, completion_ids,
        completion_mask), e.g. `task.sft_example` (see `sft_batch`).
      batch_size: examples per batch; a short last batch (finite epochs) is dropped
        so every batch has the same shape.
      seed: shuffle seed.
      pad_id: the tokenizer's padding id.
      seq_len: padded length (see `sft_batch`).
      shuffle: False keeps the records' order.
      num_epochs: passes over the records; None repeats forever.
      shard: `(index, count)`: read data shard `index` of `count` (as `prompt_loader`).
      read_options: grain prefetching; None reads synchronously in the caller's thread.

    Returns:
      A `grain.IterDataset` of `SFTBatch`, with a checkpointable iterator.

    Examples:
      >>> task = ArithmeticTask()
      >>> it = iter(sft_loader(task.train, task.sft_example, 32, 0, task.tokenizer.pad_id,
      ...                      seq_len=task.max_sequence_length))
      >>> next(it).tokens_BxL.shape
      (32, 11)
    """
    _check_loader_args("sft_loader", records, batch_size, num_epochs)
    ds = _dataset(records, seed, shuffle, num_epochs, shard).map(example_fn)
    ds = ds.batch(batch_size, drop_remainder=True,
                  batch_fn=functools.partial(_batch_examples, pad_id=pad_id, seq_len=seq_len))
    return ds.to_iter_dataset(read_options or _SYNCHRONOUS)
