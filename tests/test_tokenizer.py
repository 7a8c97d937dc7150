"""Tokenizers: the built-in character tokenizer and the `tokenizers` adapter (no downloads)."""

import json

import pytest

from jaxrl_lp.models.tokenizer import DEFAULT_ALPHABET, CharTokenizer, HFTokenizer, Tokenizer


def test_char_tokenizer_round_trip_and_fixed_ids():
    tok = CharTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 3 + len(DEFAULT_ALPHABET) <= 128  # fits the tiny presets
    text = "Q: 12+30*4-7=?\nA: 133 #### 133"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == len(text) + 2
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=False) == "<bos>" + text + "<eos>"
    assert tok.encode("0") == [3]  # ids are fixed by the alphabet: checkpoints stay valid
    assert tok.decode([0, 0, 4]) == "1"  # padding decodes to nothing


def test_char_tokenizer_errors():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=r"character '€' at position 2 .*alphabet"):
        tok.encode("1+€")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match=r"repeats characters \['1'\]"):
        CharTokenizer("0112")
    assert CharTokenizer("0123456789+=").vocab_size == 15


@pytest.fixture
def hf_dir(tmp_path):
    """A tiny WordLevel tokenizer.json with special tokens, built with `tokenizers`."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    trainer = trainers.WordLevelTrainer(special_tokens=specials)
    tok.train_from_iterator(["the answer is 42", "what is 6 times 7", "the cat"], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_hf_tokenizer_reads_special_tokens_from_tokenizer_config(hf_dir):
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None,
        "eos_token": {"content": "<|im_end|>", "lstrip": False, "special": True},
        "pad_token": "<|endoftext|>",
    }))
    tok = HFTokenizer.from_file(hf_dir)
    assert isinstance(tok, Tokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, 2, 0)
    ids = tok.encode("the answer is 42", add_eos=True)
    assert len(ids) == 5 and ids[-1] == 2
    assert tok.decode(ids) == "the answer is 42"
    assert tok.vocab_size == len(json.loads((hf_dir / "tokenizer.json").read_text())
                                 ["model"]["vocab"])
    with pytest.raises(ValueError, match="no bos token"):
        tok.encode("the", add_bos=True)
    # Explicit ids override the config (e.g. Ouro's bos/eos/pad all 0 as shipped).
    tok = HFTokenizer.from_file(hf_dir / "tokenizer.json", bos_id=1, eos_id=0)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 0, 0)


def test_hf_tokenizer_without_config_and_errors(hf_dir, tmp_path):
    tok = HFTokenizer.from_file(hf_dir)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, None, None)
    assert tok.decode(tok.encode("what is 6 times 7")) == "what is 6 times 7"
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer.from_file(tmp_path / "missing")
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match="'</s>' is not in the vocabulary"):
        HFTokenizer.from_file(hf_dir)
    with pytest.raises(TypeError, match="unknown arguments"):
        HFTokenizer.from_file(hf_dir, eos=1)
