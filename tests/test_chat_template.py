"""Chat templates (`jaxrl_lp.tasks.chat`): rendered text and token ids equal to `transformers`'.

The two templates are the Qwen3 and Qwen2.5-Instruct checkpoints' own (verbatim, in
tests/fixtures/chat/), on a small byte-level BPE tokenizer with the Qwen tokens
(tests/chat_helpers.py). `transformers` reads the same directory with `AutoTokenizer`.
"""

import json
import os

import pytest
from chat_helpers import make_chat_checkpoint_tokenizer

from jaxrl_lp.models.tokenizer import CharTokenizer, HFTokenizer
from jaxrl_lp.tasks.chat import ChatTemplate, PlainFormat, as_messages, load_chat_format

TEMPLATES = ("qwen3", "qwen2.5")

TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression, e.g. 3 < 4 & 'x'.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer with a number."}
USER = {"role": "user", "content": "What is six times seven?"}

# name -> (messages, tools, options)
CASES = {
    "user": ([USER], None, {}),
    "system": ([SYSTEM, USER], None, {}),
    "tool_message": ([SYSTEM, USER, {"role": "assistant", "content": CALL_TEXT},
                      {"role": "tool", "content": "42"}], None, {}),
    # Structured tool calls: arguments through `tojson` (HTML characters, non-ASCII), content
    # None (dropped), reasoning under an older name (aliased to reasoning_content).
    "tool_calls": ([USER, {"role": "assistant", "content": None, "reasoning": "Use the tool.",
                           "tool_calls": [{"type": "function", "function": {
                               "name": "calculator", "arguments": {"expression": "6 * 7 < 50 & 'é'"}}}]},
                    {"role": "tool", "content": "42"}, {"role": "tool", "content": "true"}], None, {}),
    "history": ([USER, {"role": "assistant", "content": "<think>\nsix sevens\n</think>\n\n42"},
                 {"role": "user", "content": "And seven sevens?"}], None, {}),
    "no_thinking": ([SYSTEM, USER], None, {"enable_thinking": False}),
    "tools": ([SYSTEM, USER], [TOOL], {}),
    "tools_no_system": ([USER, {"role": "assistant", "content": CALL_TEXT},
                         {"role": "tool", "content": "42"}], [TOOL], {}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """template name -> (directory, our ChatTemplate, our HFTokenizer, transformers' tokenizer)."""
    transformers = pytest.importorskip("transformers")
    out = {}
    for name in TEMPLATES:
        d = str(tmp_path_factory.mktemp(name.replace(".", "_")))
        make_chat_checkpoint_tokenizer(d, name)
        out[name] = (d, ChatTemplate.from_pretrained(d), HFTokenizer.from_file(d),
                     transformers.AutoTokenizer.from_pretrained(d))
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("template", TEMPLATES)
def test_text_and_ids_equal_transformers(checkpoints, template, case):
    """Rendered text (with and without the generation prompt) and the prompt's token ids
    equal `apply_chat_template`'s, on both templates, with and without a system prompt, a
    tool message, tool calls, thinking off and a tools list."""
    _, ours, tok, hf = checkpoints[template]
    messages, tools, options = CASES[case]
    for gen in (False, True):
        want = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen,
                                      tokenize=False, **options)
        assert ours.render(messages, add_generation_prompt=gen, tools=tools, **options) == want
    want_ids = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                      tokenize=True, return_dict=False, **options)
    assert ours.prompt_ids(messages, tok, tools=tools, **options) == list(want_ids)


def test_rendering_rules_equal_transformers(checkpoints, tmp_path):
    """The environment's rules, one template line each: trim_blocks and lstrip_blocks, loop
    controls, the special tokens as variables, `tojson` without HTML escaping, `documents`
    defined (None), keys with None values dropped, namespace, dict, `{% generation %}`."""
    transformers = pytest.importorskip("transformers")
    d = str(tmp_path)
    make_chat_checkpoint_tokenizer(d, "qwen3")
    source = (
        "{% for m in messages %}\n"
        "  {% if loop.index0 > 2 %}{% break %}{% endif %}\n"
        "  {% if m.role == 'system' %}{% continue %}{% endif %}\n"
        "[{{ bos_token }}|{{ eos_token }}|{{ pad_token }}] {{ m.role }}: {{ m.content }}"
        "{{ ' (named)' if m.name is defined }}\n"
        "{% endfor %}\n"
        "{{ tools | tojson }} {{ documents is defined }} {{ dict(a='<b>') | tojson(indent=1) }}\n"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
        "{{ ns.n }}{% generation %} generated{% endgeneration %}{{ strftime_now('%Y') }}")
    with open(os.path.join(d, "tokenizer_config.json")) as f:
        config = json.load(f)
    config.update(chat_template=source, bos_token="<|im_start|>")
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    messages = [SYSTEM, {"role": "user", "content": "a < b & 'c' é", "name": None},
                {"role": "assistant", "content": "x", "name": "bob"}, {"role": "user", "content": "late"}]
    ours = ChatTemplate.from_pretrained(d)
    hf = transformers.AutoTokenizer.from_pretrained(d)
    want = hf.apply_chat_template(messages, tools=[TOOL], tokenize=False)
    assert "late" not in want and "(named)" in want and "\\u003c" not in want  # the rules bite
    assert ours.render(messages, tools=[TOOL]) == want


def test_named_templates_and_jinja_file_as_transformers_picks_them(tmp_path):
    """A list of named templates: `default` without tools, `tool_use` with them; a
    `chat_template.jinja` beside the config wins over the config's `chat_template`."""
    transformers = pytest.importorskip("transformers")
    named, jinja = str(tmp_path / "named"), str(tmp_path / "jinja")
    make_chat_checkpoint_tokenizer(named, "qwen2.5")
    make_chat_checkpoint_tokenizer(jinja, "qwen3", jinja_file=True)
    for d, entry in ((named, [{"name": "default", "template": "D:{{ messages[0].content }}"},
                              {"name": "tool_use", "template": "T:{{ tools | length }}"}]),
                     (jinja, "the config's template, which the .jinja file replaces")):
        with open(os.path.join(d, "tokenizer_config.json")) as f:
            config = json.load(f)
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump({**config, "chat_template": entry}, f)
    for d in (named, jinja):
        ours, hf = ChatTemplate.from_pretrained(d), transformers.AutoTokenizer.from_pretrained(d)
        for tools in (None, [TOOL]):
            want = hf.apply_chat_template([USER], tools=tools, tokenize=False, add_generation_prompt=True)
            assert ours.render([USER], tools=tools, add_generation_prompt=True) == want
    assert ChatTemplate.from_pretrained(named).render([USER], tools=[TOOL]) == "T:1"
    assert ChatTemplate.from_pretrained(jinja).origin.endswith("chat_template.jinja")


@pytest.mark.parametrize("template", TEMPLATES)
def test_observation_text_continues_the_rendered_conversation(checkpoints, template):
    """render(conversation + [model turn] + answer, generation prompt) == render(conversation,
    generation prompt) + turn + observation_text(answer, 'stop'), in text and in token ids
    (the context is never re-tokenized); 'eos' leaves out the leading EOS, whose id the
    model's turn already holds."""
    _, ours, tok, _ = checkpoints[template]
    turns = (CALL_TEXT, "<think>\nsix sevens\n</think>\n\n" + CALL_TEXT, "It is 42.")
    answers = ([{"role": "tool", "content": "42"}],
               [{"role": "tool", "content": "42"}, {"role": "tool", "content": "error: none"}],
               [{"role": "user", "content": "Are you sure?"}])
    for conversation, tools in (([USER], None), ([SYSTEM, USER], None), ([SYSTEM, USER], [TOOL])):
        for turn in turns:
            for answer in answers:
                whole = conversation + [{"role": "assistant", "content": turn}] + answer
                full = ours.render(whole, add_generation_prompt=True, tools=tools)
                stop = ours.observation_text(answer, ended_by="stop", tools=tools)
                appended = ours.render(conversation, add_generation_prompt=True, tools=tools) + turn + stop
                if template == "qwen3" and "<think>" in turn and answer[0]["role"] == "user":
                    # Qwen3 drops the reasoning of turns before the last user message: its
                    # re-rendering is not the appended context (docs of observation_text).
                    assert full != appended
                    continue
                assert full == appended
                head = ours.prompt_ids(conversation, tok, tools=tools) + tok.encode(turn)
                assert head + tok.encode(stop) == tok.encode(full)
                eos = ours.observation_text(answer, ended_by="eos", tools=tools)
                assert stop == "<|im_end|>" + eos
                assert head + [tok.eos_id] + tok.encode(eos) == tok.encode(full)
    if template == "qwen3":  # the empty think block of enable_thinking=False is not re-rendered
        answer = [{"role": "tool", "content": "42"}]
        off = ours.render([USER], add_generation_prompt=True, enable_thinking=False) + "It is 42." + \
            ours.observation_text(answer, ended_by="stop", enable_thinking=False)
        assert off != ours.render([USER, {"role": "assistant", "content": "It is 42."}] + answer,
                                  add_generation_prompt=True, enable_thinking=False)
        assert ours.observation_text(answer, ended_by="stop", enable_thinking=False).endswith(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ours.observation_text([{"role": "tool", "content": "RESULT"}], ended_by="stop") == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nRESULT\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_a_checkpoint_without_a_template_uses_the_plain_format(tmp_path):
    """No template: `from_pretrained` is None, `load_chat_format` says so once and returns
    `PlainFormat`: a lone user message is its text, otherwise Role: content blocks."""
    CharTokenizer().save(tmp_path)
    assert ChatTemplate.from_pretrained(tmp_path) is None
    said = []
    plain = load_chat_format(tmp_path, say=said.append)
    assert isinstance(plain, PlainFormat) and len(said) == 1 and "no chat template" in said[0]
    assert plain.render([USER], add_generation_prompt=True) == USER["content"]
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = "System: Be brief.\n\nUser: 2+2?\n\nAssistant:"
    assert plain.render(system, add_generation_prompt=True) == text
    assert plain.render(system) == text.removesuffix("\n\nAssistant:")
    tok = CharTokenizer()
    assert plain.prompt_ids(system, tok) == tok.encode(text, add_bos=True)
    answer = [{"role": "tool", "content": "7"}, {"role": "user", "content": "go on"}]
    assert plain.observation_text(answer, ended_by="eos") == "7\ngo on\n"
    qwen = tmp_path / "qwen"
    make_chat_checkpoint_tokenizer(qwen, "qwen3")
    assert isinstance(load_chat_format(qwen, say=said.append), ChatTemplate) and len(said) == 1


def test_as_messages():
    """A string becomes a user message; a system prompt goes first unless one is there."""
    assert as_messages("2+2?") == [{"role": "user", "content": "2+2?"}]
    assert as_messages("2+2?", "Be brief.") == [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "2+2?"}]
    assert as_messages([SYSTEM, USER], "Be brief.") == [SYSTEM, USER]
    assert as_messages([USER], "Be brief.")[0] == {"role": "system", "content": "Be brief."}
    with pytest.raises(ValueError, match="message 0 has no 'role'"):
        as_messages([{"content": "x"}])


def test_bad_input_is_one_line(tmp_path):
    """A message without role or content, a template that raises or does not parse, a bad
    `ended_by`, bad tools, a bad config: each one ValueError line naming it."""
    qwen = ChatTemplate(open(os.path.join(os.path.dirname(__file__), "fixtures", "chat",
                                          "qwen3.jinja")).read(), eos_token="<|im_end|>")
    bad_type, bad_json = tmp_path / "type", tmp_path / "json"
    for d, text in ((bad_type, json.dumps({"chat_template": 5})), (bad_json, "{not json")):
        d.mkdir()
        (d / "tokenizer_config.json").write_text(text)
    raises = ChatTemplate("{{ raise_exception('System role not supported') }}")
    echo = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")  # no eos_token
    cases = [
        (lambda: qwen.render([{"content": "x"}]), "message 0 has no 'role'"),
        (lambda: qwen.render([{"role": "user"}]), r"message 0 \(user\) has no 'content'"),
        (lambda: qwen.render(["hi"]), "message 0 is a str"),
        (lambda: qwen.render([]), "the conversation is empty"),
        (lambda: qwen.render("hi"), "must be a list"),
        (lambda: qwen.render([USER], tools="calculator"), "tools must be a list"),
        (lambda: raises.render([USER]), "refused the conversation: System role not supported"),
        (lambda: ChatTemplate("{% for m in messages %}"), "does not parse"),
        (lambda: qwen.observation_text([USER], ended_by="done"), "ended_by='done'"),
        (lambda: echo.observation_text([USER], ended_by="eos"), "ended_by='eos'"),
        (lambda: ChatTemplate.from_pretrained(bad_type), "chat_template must be a string or a list"),
        (lambda: ChatTemplate.from_pretrained(bad_json), "not valid JSON"),
        (lambda: PlainFormat().render([{"role": "user", "content": [{"text": "x"}]}]), "no text content"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            call()
        assert "\n" not in str(info.value), str(info.value)
