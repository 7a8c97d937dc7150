"""A small Qwen-style tokenizer with a real chat template, for tests of checkpoints that chat.

`make_chat_checkpoint_tokenizer(dir)` writes `tokenizer.json` and `tokenizer_config.json` into a
checkpoint directory: a byte-level BPE (every byte has an id, so any text encodes) trained on a
few hundred words, the Qwen tokens the templates write (`<|endoftext|>`, `<|im_start|>` and
`<|im_end|>` special; `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>`,
`<think>`, `</think>` added, not special, as in the Qwen checkpoints, so decoding keeps them),
EOS `<|im_end|>`, padding `<|endoftext|>`, no BOS, and the verbatim Qwen3 or Qwen2.5-Instruct
chat template from `tests/fixtures/chat/`. `jaxrl_lp.models.tokenizer.HFTokenizer.from_file`,
`jaxrl_lp.tasks.chat.ChatTemplate.from_pretrained` and `transformers.AutoTokenizer` read it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "chat")
TEMPLATE_FILES = {"qwen3": "qwen3.jinja", "qwen2.5": "qwen2_5.jinja"}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                "</think>")

# Training text: plain sentences, numbers and the words of tool calls, so merges form.
CORPUS = """\
You are a helpful assistant. Answer the question with a number, then stop.
What is the sum of twelve and thirty? The answer is 42. What is 7 times 8? It is 56.
The user asks a question and the assistant answers it. A tool returns a result, and the
assistant reads the result before it answers. Think step by step, then give the answer.
Use the calculator tool when the numbers are large: call it with an expression such as
123 + 456 or 98 * 76, read its response, and write the final answer on its own line.
The system prompt says how to answer. The model thinks inside think tags and calls tools
inside tool call tags; the tool response comes back inside tool response tags.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 30 40 50 64 75 99 100 128.
Arithmetic: 2 + 2 = 4, 9 - 3 = 6, 6 * 7 = 42, 81 / 9 = 9, 15 + 27 = 42, 100 - 58 = 42.
The quick brown fox jumps over the lazy dog. A small model learns to add two numbers.
Reward is one when the answer matches and zero otherwise. The held out accuracy rises.
{"name": "calculator", "arguments": {"expression": "3 + 4"}} {"result": "7"}
function parameters type object properties string description required name arguments
Question: Tom has 3 apples and buys 5 more. How many apples does he have? Answer: 8.
Question: A train travels 60 miles in 2 hours. What is its speed? Answer: 30 miles per hour.
Question: What is half of 90? Answer: 45. Question: What is 11 squared? Answer: 121.
Please reason about the problem first, and put the final answer at the end of the reply.
"""


def make_chat_checkpoint_tokenizer(path: str | os.PathLike, template: str = "qwen3",
                                   corpus: str | Iterable[str] | None = None, *,
                                   vocab_size: int = 320, jinja_file: bool = False) -> None:
    """Writes a Qwen-style `tokenizer.json` + `tokenizer_config.json` with a chat template.

    Args:
      path: the checkpoint directory (created if needed).
      template: `qwen3` or `qwen2.5`: which verbatim chat template it carries.
      corpus: text (a string, or lines) the BPE merges are learned from, e.g. a dataset's
        prompts; default: `CORPUS`. Bytes it lacks still encode, one id each.
      vocab_size: the BPE's size (256 bytes and the merges), before the 9 Qwen tokens.
      jinja_file: write the template as `chat_template.jinja` (the newer layout) instead of
        the config's `chat_template`.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    if template not in TEMPLATE_FILES:
        raise ValueError(f"template={template!r}; expected one of {sorted(TEMPLATE_FILES)}")
    with open(os.path.join(FIXTURES, TEMPLATE_FILES[template]), encoding="utf-8") as f:
        source = f.read()
    lines = CORPUS.splitlines() if corpus is None else (
        corpus.splitlines() if isinstance(corpus, str) else list(corpus))

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                       "rstrip": False, "single_word": False,
                                       "special": t in SPECIAL_TOKENS}
             for t in SPECIAL_TOKENS + ADDED_TOKENS}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added,
              "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "unk_token": None, "clean_up_tokenization_spaces": False, "model_max_length": 4096}
    if jinja_file:
        with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(source)
    else:
        config["chat_template"] = source
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
