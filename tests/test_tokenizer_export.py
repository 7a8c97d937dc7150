"""`CharTokenizer.save`: a Hugging Face tokenizer that reads back to exactly our ids."""

import json

import pytest

from jaxrl_lp.models.tokenizer import CharTokenizer, HFTokenizer

TEXT = "12+30=24\n#### 42, (a - b) * c / d: 'yes'? \"no\"!"


def test_hf_tokenizer_reads_back_every_id(tmp_path):
    tok = CharTokenizer()
    assert tok.save(tmp_path, model_max_length=64) == ["tokenizer.json", "tokenizer_config.json"]
    back = HFTokenizer.from_file(tmp_path)
    assert back.vocab_size == tok.vocab_size
    assert (back.pad_id, back.bos_id, back.eos_id) == (tok.pad_id, tok.bos_id, tok.eos_id)
    for c in tok.alphabet:  # every character alone, spaces and newlines included
        assert back.encode(c) == tok.encode(c), repr(c)
    assert back.encode(tok.alphabet) == tok.encode(tok.alphabet)
    ids = tok.encode(TEXT, add_bos=True, add_eos=True)
    assert back.encode(TEXT, add_bos=True, add_eos=True) == ids
    assert back.decode(ids) == TEXT == tok.decode(ids)
    for i, special in enumerate(CharTokenizer.SPECIALS):
        assert back.tokenizer.token_to_id(special) == i
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("<bos>", "<eos>", "<pad>")
    assert cfg["model_max_length"] == 64


def test_transformers_reads_the_same_ids(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = CharTokenizer(alphabet="0123456789+= \n")
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert len(hf) == tok.vocab_size
    text = "12 + 30 =\n42"
    # No post-processor: transformers adds no special token implicitly either.
    assert hf(text)["input_ids"] == tok.encode(text)
    assert all(hf(c, add_special_tokens=False)["input_ids"] == tok.encode(c) for c in tok.alphabet)
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert hf.decode(ids, skip_special_tokens=True) == text
    assert hf.convert_ids_to_tokens([0, 1, 2]) == list(CharTokenizer.SPECIALS)
