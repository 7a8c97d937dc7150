"""Tokenizers: a `Tokenizer` protocol, a built-in character tokenizer and a `tokenizers` adapter.

`CharTokenizer` serves the generated arithmetic task: its ids are fixed by its
alphabet, so a model trained with it needs no tokenizer file. `HFTokenizer`
wraps a local Hugging Face `tokenizer.json` (no hub access), taking the special
tokens from the `tokenizer_config.json` next to it when there is one.

Special tokens are never added implicitly: `encode(text)` returns the ids of
`text` only; ask for `add_bos` / `add_eos` explicitly. `decode` drops special
tokens unless told otherwise.
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["DEFAULT_ALPHABET", "CharTokenizer", "HFTokenizer", "Tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline, sampler and rewards need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def pad_id(self) -> int | None: ...

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str: ...


def _with_specials(ids: list[int], bos: int | None, eos: int | None, add_bos: bool,
                   add_eos: bool) -> list[int]:
    if (add_bos and bos is None) or (add_eos and eos is None):
        which = "bos" if add_bos and bos is None else "eos"
        raise ValueError(f"encode: add_{which}=True but the tokenizer has no {which} token")
    return ([bos] if add_bos else []) + ids + ([eos] if add_eos else [])


# Digits, arithmetic, punctuation, whitespace and letters: enough for the
# arithmetic task and GSM8K-style "#### 42" answers. Order fixes the ids.
DEFAULT_ALPHABET = (
    string.digits + "+-*/=()<>.,:;?!#%$'\"_ \n" + string.ascii_lowercase + string.ascii_uppercase
)


class CharTokenizer:
    """One id per character of a fixed alphabet, after `<pad>`=0, `<bos>`=1, `<eos>`=2.

    Args:
      alphabet: the characters, each once; their ids are 3, 4, ... in order.

    Examples:
      >>> tok = CharTokenizer()
      >>> tok.decode(tok.encode("12+30=42", add_eos=True))
      '12+30=42'
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>")

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            dupes = sorted({c for c in alphabet if alphabet.count(c) > 1})
            raise ValueError(f"CharTokenizer: alphabet repeats characters {dupes}")
        self.alphabet = alphabet
        self._ids = {c: i + len(self.SPECIALS) for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.SPECIALS) + len(self.alphabet)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Maps each character to its id; a character outside the alphabet is an error."""
        try:
            ids = [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(
                f"CharTokenizer: character {e.args[0]!r} at position {text.index(e.args[0])} of "
                f"{text[:40]!r} is not in the alphabet; pass alphabet= with it included"
            ) from None
        return _with_specials(ids, self.bos_id, self.eos_id, add_bos, add_eos)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Maps ids back to text; special tokens are dropped or written as `<bos>` etc."""
        out = []
        for i in map(int, ids):
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"CharTokenizer: id {i} is out of range [0, {self.vocab_size})"
                )
            if i < len(self.SPECIALS):
                if not skip_special:
                    out.append(self.SPECIALS[i])
            else:
                out.append(self.alphabet[i - len(self.SPECIALS)])
        return "".join(out)

    def save(self, path: str | os.PathLike, model_max_length: int | None = None) -> list[str]:
        """Writes this tokenizer as a Hugging Face `tokenizer.json` + `tokenizer_config.json`.

        Built with the `tokenizers` library: a `WordLevel` vocabulary (the
        specials, then the alphabet, so every id is ours), a pre-tokenizer
        splitting the text into single characters (`[\\s\\S]`, newlines
        included), no normalizer, no post-processor (nothing is added
        implicitly) and a `Fuse` decoder (tokens joined without spaces).
        `HFTokenizer.from_file` and `transformers.AutoTokenizer` read it back to
        the same ids for every character and special, and the same special ids.
        One difference remains: those readers match special tokens written as
        text (`"<eos>"` encodes to id 2), where `encode` here spells them out.

        Args:
          path: output directory (created if needed).
          model_max_length: recorded in `tokenizer_config.json` when given.

        Returns:
          The file names written.

        Examples:
          >>> CharTokenizer().save("out/ckpt")
          ['tokenizer.json', 'tokenizer_config.json']
        """
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as _Tokenizer

        vocab = {s: i for i, s in enumerate(self.SPECIALS)} | dict(self._ids)
        tok = _Tokenizer(models.WordLevel(vocab, unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                                for s in self.SPECIALS])
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        tok.save(os.path.join(path, "tokenizer.json"))
        pad, bos, eos = self.SPECIALS
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
                  "eos_token": eos, "pad_token": pad, "clean_up_tokenization_spaces": False}
        if model_max_length is not None:
            config["model_max_length"] = int(model_max_length)
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        return ["tokenizer.json", "tokenizer_config.json"]


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json stores a special token as a string or as an
    # AddedToken dict {"content": ..., "lstrip": ..., ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` behind the `Tokenizer` protocol.

    Build it with `HFTokenizer.from_file`. `encode` never applies the
    tokenizer's post-processor (no implicit BOS/EOS); `vocab_size` counts the
    added tokens too.

    Examples:
      >>> tok = HFTokenizer.from_file("checkpoints/Qwen3-0.6B")
      >>> tok.decode(tok.encode("hello world"))
      'hello world'
    """

    def __init__(self, tokenizer: Any, *, bos_id: int | None = None, eos_id: int | None = None,
                 pad_id: int | None = None):
        self.tokenizer = tokenizer
        self._bos, self._eos, self._pad = bos_id, eos_id, pad_id

    @classmethod
    def from_file(cls, path: str | os.PathLike, **special_ids: int | None) -> HFTokenizer:
        """Loads `tokenizer.json` (a file, or a directory holding one).

        Special tokens come from `tokenizer_config.json` (`bos_token`,
        `eos_token`, `pad_token`), else `special_tokens_map.json`, in the same
        directory; keyword arguments `bos_id=`, `eos_id=`, `pad_id=` override them.

        Args:
          path: `tokenizer.json` or its directory.
          **special_ids: explicit `bos_id` / `eos_id` / `pad_id`.

        Returns:
          The adapter.
        """
        from tokenizers import Tokenizer as _Tokenizer

        unknown = set(special_ids) - {"bos_id", "eos_id", "pad_id"}
        if unknown:
            raise TypeError(f"HFTokenizer.from_file: unknown arguments {sorted(unknown)}; "
                            "allowed: bos_id, eos_id, pad_id")
        path = os.fspath(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(
                f"no tokenizer file at {file!r}; pass a tokenizer.json or the directory holding "
                "it (a slow-tokenizer checkpoint with only vocab files must be converted first)"
            )
        tok = _Tokenizer.from_file(file)
        ids: dict[str, int | None] = {}
        for cfg_name in ("tokenizer_config.json", "special_tokens_map.json"):
            cfg_file = os.path.join(os.path.dirname(file), cfg_name)
            if not os.path.isfile(cfg_file):
                continue
            with open(cfg_file) as f:
                cfg = json.load(f)
            for role in ("bos", "eos", "pad"):
                content = _token_content(cfg.get(f"{role}_token"))
                if content is not None and ids.get(role) is None:
                    ids[role] = tok.token_to_id(content)
                    if ids[role] is None:
                        raise ValueError(f"{cfg_file}: {role}_token {content!r} is not in the "
                                         f"vocabulary of {file}")
        for role in ("bos", "eos", "pad"):
            if f"{role}_id" in special_ids:
                ids[role] = special_ids[f"{role}_id"]
        return cls(tok, bos_id=ids.get("bos"), eos_id=ids.get("eos"), pad_id=ids.get("pad"))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._eos

    @property
    def pad_id(self) -> int | None:
        return self._pad

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return _with_specials(list(ids), self._bos, self._eos, add_bos, add_eos)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)
