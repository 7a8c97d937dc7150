"""A user's records from local files, read with Hugging Face `datasets`, offline.

`load_records(path)` reads a JSONL / JSON / Parquet / CSV file, a directory a
`datasets` `save_to_disk` wrote, or a directory of data files (the layout a dataset
repository has: `data/train-*.parquet`, `test.jsonl`, ...), and returns its splits as
lists of dicts (`{"train": [...], "test": [...]}`). Nothing is downloaded and nothing is
cached outside a temporary directory: `datasets` builds its Arrow copy there, in memory.

`check_prompts` checks the column a task reads its prompts from: a string, or a chat
`messages` list (dicts with `role` and `content`), naming the first bad record.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

__all__ = ["check_prompts", "load_records", "prompt_key_text"]

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_SAVED = ("dataset_info.json", "state.json", "dataset_dict.json")


def _to_lists(data: Any) -> dict[str, list[dict]]:
    """`{split: records}` of a `datasets.Dataset` (one split, `train`) or `DatasetDict`."""
    import datasets

    if isinstance(data, datasets.Dataset):
        return {"train": data.to_list()}
    return {name: split.to_list() for name, split in data.items()}


def load_records(path: str | os.PathLike, key: str = "task.path") -> dict[str, list[dict]]:
    """The splits of a local data source, each a list of records (dicts), in file order.

    Args:
      path: a `.jsonl`, `.json`, `.parquet` or `.csv` file, a `datasets.save_to_disk`
        directory, or a directory of such files (split names from the file names, as
        `datasets.load_dataset(directory)` infers them).
      key: the config key `path` came from, for messages.

    Returns:
      `{split name: [record, ...]}`: a file gives `{"train": ...}`.

    Raises:
      ValueError: no such file or directory, an unsupported extension, a file `datasets`
        cannot parse, or no records (one line naming `key`).

    Examples:
      >>> load_records("data/sums.jsonl")["train"][0]
      {'prompt': '23+58=', 'answer': '81'}
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"{key}={path!r} does not exist; pass a local JSONL, JSON, Parquet or "
                         "CSV file, or a datasets directory")
    import datasets

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="jaxrl_lp_records_") as cache:
        try:
            if os.path.isdir(path):
                if any(os.path.isfile(os.path.join(path, f)) for f in _SAVED):
                    data = datasets.load_from_disk(path, keep_in_memory=True)
                else:
                    data = datasets.load_dataset(path, cache_dir=cache, keep_in_memory=True)
            else:
                suffix = os.path.splitext(path)[1].lower()
                if suffix not in _BUILDERS:
                    raise ValueError(f"{key}={path!r}: unsupported extension {suffix!r}; use "
                                     f"{', '.join(sorted(_BUILDERS))} or a datasets directory")
                data = datasets.load_dataset(_BUILDERS[suffix], data_files=path, split="train",
                                             cache_dir=cache, keep_in_memory=True)
            splits = _to_lists(data)
        except ValueError as e:
            text = " ".join(str(e).split())
            raise ValueError(text if text.startswith(key) else f"{key}={path!r}: {text}") from None
        except Exception as e:  # noqa: BLE001 - datasets/pyarrow raise many types on bad files
            text = " ".join(str(e).split())[:300]
            raise ValueError(f"{key}={path!r} cannot be read ({type(e).__name__}: {text}); "
                             "write one JSON object per line, or a Parquet or CSV table") from None
    splits = {name: records for name, records in splits.items() if records}
    if not splits:
        raise ValueError(f"{key}={path!r} holds no records; it needs at least one")
    return splits


def prompt_key_text(prompt: Any) -> str:
    """The text a record's split is decided by (`data.in_heldout`): the prompt itself, or
    its messages' contents joined."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in prompt)


def check_prompts(records: Sequence[dict], prompt_key: str, where: str,
                  key: str = "task.prompt_key") -> None:
    """Raises where a record has no `prompt_key` column or its prompt is neither a string nor
    a list of chat messages (dicts with a string `role` and `content`)."""
    for i, record in enumerate(records):
        if prompt_key not in record:
            raise ValueError(f"{key}={prompt_key!r}: {where} has no such column (columns: "
                             f"{sorted(record)}); set {key} to the column holding the prompts")
        prompt = record[prompt_key]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{key}={prompt_key!r}: {where} record {i} has an empty prompt")
            continue
        ok = isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in prompt)
        if not ok:
            raise ValueError(f"{key}={prompt_key!r}: {where} record {i}'s prompt is "
                             f"{str(prompt)[:60]!r}; a prompt is a string or a list of "
                             "messages, each {'role': ..., 'content': ...}")
