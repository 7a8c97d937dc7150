"""Chat formats: a checkpoint's own chat template, rendered as `transformers` renders it, or a plain format.

A Hugging Face checkpoint carries its chat template as Jinja source: the `chat_template` of its
`tokenizer_config.json` (a string, or a list of named templates), or a `chat_template.jinja` file
beside it. `ChatTemplate` renders it the way `transformers`' `apply_chat_template` does, without
importing `transformers`: a sandboxed `jinja2` environment with `trim_blocks`, `lstrip_blocks` and
loop controls, a `tojson` filter that leaves HTML characters and non-ASCII text as they are, the
`raise_exception` and `strftime_now` functions, and the tokenizer's special tokens (`bos_token`,
`eos_token`, ...) as variables. Options such as Qwen3's `enable_thinking=False` are variables too.
So a prompt's token ids equal `apply_chat_template(..., tokenize=True)`'s for the same messages.

A multi-turn task never re-renders its conversation: the sampler's tokens stay as they were, and
what an environment answers is appended as the text the template writes between a model turn
and the next generation prompt (`observation_text`), encoded on its own. Where a template's
rendering of a conversation is a prefix of the rendering of its continuation, the result is
the token ids of the whole rendered conversation: Qwen2.5 always; Qwen3 with tool answers, and
with user answers after a turn without reasoning (Qwen3 drops the reasoning of turns before the
last user message when it re-renders them, and with `enable_thinking=False` its generation
prompt holds an empty think block the re-rendering leaves out).

A checkpoint without a template uses `PlainFormat`: a lone user message is its text, anything
else `System: ...\\n\\nUser: ...\\n\\nAssistant:`. `load_chat_format` picks one and says once when
it falls back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jinja2

from jaxrl_lp.models.tokenizer import Tokenizer
from jaxrl_lp.tasks.jinja_env import compile_template

__all__ = ["ChatFormat", "ChatTemplate", "PlainFormat", "as_messages", "load_chat_format",
           "parse_template_options"]

# Where an assistant message's content stands while `observation_text` finds what follows it.
_SENTINEL = "\u27e6jaxrl-lp model turn\u27e7"
# Older names of a message's reasoning; `transformers` copies them to `reasoning_content`
# (the name chat templates read) and `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_ENDED_BY = ("eos", "stop", "length")


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


# --- messages ------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """What a template may see: JSON-like data rebuilt from plain types (as `transformers`
    does), so no object with methods of its own reaches the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and hasattr(value, "dtype"):  # a numpy scalar
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _check_messages(messages: Any, where: str) -> list[dict]:
    """The messages as fresh dicts, checked: each has a string `role` and a `content` (an
    assistant message with `tool_calls` may leave it out)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"{where}: messages must be a list of {{'role': ..., 'content': ...}} "
                         f"dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError(f"{where}: the conversation is empty; give at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"{where}: message {i} is a {type(m).__name__}, not a dict with "
                             "'role' and 'content'")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"{where}: message {i} has no 'role' (a string: system, user, "
                             f"assistant, tool); its keys are {sorted(map(str, m))}")
        if m.get("content") is None and not m.get("tool_calls"):
            raise ValueError(f"{where}: message {i} ({m['role']}) has no 'content'; give its "
                             "text as content (only an assistant message with tool_calls may omit it)")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def as_messages(prompt: str | Sequence[Mapping[str, Any]],
                system_prompt: str | None = None) -> list[dict]:
    """A prompt as chat messages.

    Args:
      prompt: a string (one user message), or a list of messages (dicts with `role` and
        `content`), checked.
      system_prompt: put first as a system message when given and the messages have none.

    Returns:
      New message dicts.

    Examples:
      >>> as_messages("2+2?", system_prompt="Answer with a number.")
      [{'role': 'system', 'content': 'Answer with a number.'}, {'role': 'user', 'content': '2+2?'}]
    """
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = _check_messages(prompt, "as_messages")
    if system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _check_ended_by(ended_by: str) -> None:
    if ended_by not in _ENDED_BY:
        raise ValueError(f"observation_text: ended_by={ended_by!r}; expected one of {_ENDED_BY}")


# --- a checkpoint's template ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class ChatTemplate:
    """A checkpoint's own chat template (the Jinja source of Hugging Face's
    `tokenizer_config.json` `chat_template`, or `chat_template.jinja` beside it).

    Attributes:
      source: the Jinja source used without tools (the `default` of named templates).
      bos_token: the BOS token's text, as the template sees it (`None`: it has none).
      eos_token: the EOS token's text; `observation_text(ended_by="eos")` leaves it out.
      special_tokens: the tokenizer's other named tokens (`pad_token`, `unk_token`, ...) by
        variable name, passed to the template as `transformers` passes them.
      tool_use_source: the `tool_use` template of named templates, used when tools are given.
      origin: what error messages call it (the file it came from).

    Examples:
      >>> chat = ChatTemplate.from_pretrained("checkpoints/Qwen3-0.6B")
      >>> chat.render([{"role": "user", "content": "2+2?"}], add_generation_prompt=True,
      ...             enable_thinking=False)
      '<|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n'
    """

    source: str
    bos_token: str | None = None
    eos_token: str | None = None
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tool_use_source: str | None = None
    origin: str = "chat template"

    def __post_init__(self):
        object.__setattr__(self, "special_tokens", MappingProxyType(dict(self.special_tokens)))
        for source in (self.source, self.tool_use_source):
            if source is None:
                continue
            if not isinstance(source, str):
                raise ValueError(f"{self.origin}: a chat template is Jinja source text, got "
                                 f"{type(source).__name__}")
            try:
                compile_template(source)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"{self.origin}: the chat template does not parse (line "
                                 f"{e.lineno}: {_one_line(e.message)})") from e

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ChatTemplate | None:
        """Reads a checkpoint's chat template, as `transformers.AutoTokenizer` finds it.

        `chat_template.jinja` (and named templates in `chat_templates/NAME.jinja`) take
        priority over the `chat_template` of `tokenizer_config.json`, which is a string or a
        list of `{"name", "template"}`. The special tokens are the config's `*_token` entries
        (a string, or a token dict's `content`); `special_tokens_map.json` supplies them in
        an older layout without `added_tokens_decoder`.

        Args:
          path: a checkpoint directory, or its `tokenizer_config.json`.

        Returns:
          The template, or `None` when the checkpoint has none.

        Raises:
          FileNotFoundError: `path` does not exist.
          ValueError: one line naming the file and what is wrong in it.
        """
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no checkpoint at {path!r}: pass a checkpoint directory or "
                                    "its tokenizer_config.json")
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        config_file = path if not os.path.isdir(path) else os.path.join(folder, "tokenizer_config.json")
        config = _read_json(config_file) if os.path.isfile(config_file) else {}

        templates: dict[str, str] = {}
        jinja_file = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            templates["default"] = _read_text(jinja_file)
        named_dir = os.path.join(folder, "chat_templates")
        if os.path.isdir(named_dir):
            for name in sorted(os.listdir(named_dir)):
                if name.endswith(".jinja"):
                    templates[name.removesuffix(".jinja")] = _read_text(os.path.join(named_dir, name))
        origin = jinja_file if templates else config_file
        if not templates:
            entry = config.get("chat_template")
            if entry is None:
                return None
            if isinstance(entry, str):
                templates["default"] = entry
            elif isinstance(entry, list) and all(isinstance(t, Mapping) and {"name", "template"} <= set(t)
                                                 for t in entry):
                templates = {t["name"]: t["template"] for t in entry}
            else:
                raise ValueError(f"{config_file}: chat_template must be a string or a list of "
                                 f"{{'name', 'template'}} entries, got {type(entry).__name__}")
        if "default" not in templates:
            raise ValueError(f"{origin}: the named chat templates {sorted(templates)} have no "
                             "'default'; name the one to use without tools 'default'")

        tokens = _special_tokens(config)
        if "added_tokens_decoder" not in config:
            legacy = os.path.join(folder, "special_tokens_map.json")
            if os.path.isfile(legacy):
                tokens.update(_special_tokens(_read_json(legacy)))
        bos, eos = tokens.pop("bos_token", None), tokens.pop("eos_token", None)
        return cls(templates["default"], bos_token=bos, eos_token=eos, special_tokens=tokens,
                   tool_use_source=templates.get("tool_use"), origin=origin)

    def variables(self) -> dict[str, str]:
        """The special tokens' variables every rendering gets (`bos_token`, `eos_token`, ...)."""
        named = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        return {**self.special_tokens, **{k: v for k, v in named.items() if v is not None}}

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None, **options: Any) -> str:
        """The conversation as the template writes it.

        Equal to `transformers`' `apply_chat_template(messages, tools=tools,
        add_generation_prompt=..., tokenize=False, **options)` for the same checkpoint.

        Args:
          messages: dicts with `role` and `content` (an assistant's may carry `tool_calls`,
            `reasoning_content`); keys whose value is `None` are left out.
          add_generation_prompt: end with the opening of an assistant turn.
          tools: JSON-schema tool descriptions (`{"type": "function", "function": {...}}`);
            given (even empty), a `tool_use` template is preferred.
          **options: template variables, e.g. `enable_thinking=False`.

        Returns:
          The rendered text.

        Raises:
          ValueError: one line, for a malformed message or tool, or a template that raises
            (its `raise_exception` message).
        """
        messages = [_alias_reasoning(m) for m in _plain(_check_messages(messages, self.origin))]
        if tools is not None:
            if isinstance(tools, (str, Mapping)) or not all(isinstance(t, Mapping) for t in tools):
                raise ValueError(f"{self.origin}: tools must be a list of JSON-schema dicts "
                                 "({'type': 'function', 'function': {'name': ..., 'parameters': ...}})")
            tools = _plain(list(tools))
        source = self.tool_use_source if tools is not None and self.tool_use_source else self.source
        variables = {**self.variables(), **_plain(options)}
        try:
            return compile_template(source).render(messages=messages, tools=tools, documents=None,
                                           add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise ValueError(f"{self.origin}: the chat template refused the conversation: "
                             f"{_one_line(e)}") from e
        except Exception as e:  # a template is code: any failure inside it is the template's
            raise ValueError(f"{self.origin}: the chat template failed on the conversation: "
                             f"{type(e).__name__}: {_one_line(e)}") from e

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, *,
                   tools: Sequence[Mapping[str, Any]] | None = None, **options: Any) -> list[int]:
        """The sampler's prompt: `render(add_generation_prompt=True)` encoded with nothing
        added (the template writes its own opening), equal to `apply_chat_template`'s ids.

        Args:
          messages: the conversation so far.
          tokenizer: the checkpoint's `models.Tokenizer` (special tokens in the text encode
            to their ids).
          tools, **options: as for `render`.

        Returns:
          Token ids.
        """
        return tokenizer.encode(self.render(messages, add_generation_prompt=True, tools=tools,
                                            **options))

    def observation_text(self, messages: Sequence[Mapping[str, Any]], *, ended_by: str,
                         tools: Sequence[Mapping[str, Any]] | None = None, **options: Any) -> str:
        """The text that follows a model turn when `messages` answer it, up to and including
        the next generation prompt.

        Found by rendering a model turn whose content is a marker, followed by `messages`,
        with a generation prompt: everything after the marker (the text the template writes
        there, whatever came before the turn). For Qwen3 and a tool result
        `RESULT`: `'<|im_end|>\\n<|im_start|>user\\n<tool_response>\\nRESULT\\n</tool_response>'
        '<|im_end|>\\n<|im_start|>assistant\\n'`.

        Args:
          messages: the answer: `tool` messages (a tool's results) or a `user` message.
          ended_by: how the model's turn ended: `eos` (its EOS token, already in the
            context, closed the turn: the leading EOS text is left out), `stop` (a stop token
            such as `</tool_call>`) or `length` (the token budget): the turn's closing is kept.
          tools, **options: as for `render`.

        Returns:
          The text to encode and append to the context.

        Raises:
          ValueError: `ended_by` is unknown, or `eos` where the template does not close a
            turn with `eos_token`, or the template does not write an assistant's content as is.
        """
        _check_ended_by(ended_by)
        turn = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]
        text = self.render(turn + list(messages), add_generation_prompt=True, tools=tools, **options)
        if text.count(_SENTINEL) != 1:
            raise ValueError(f"{self.origin}: the template does not write an assistant message's "
                             "content as given, so what follows a model turn cannot be found")
        text = text.split(_SENTINEL)[1]
        if ended_by == "eos":
            if not self.eos_token or not text.startswith(self.eos_token):
                raise ValueError(f"{self.origin}: ended_by='eos' but the template closes a model "
                                 f"turn with {text[:24]!r}, not eos_token {self.eos_token!r}; "
                                 "pass ended_by='stop'")
            text = text[len(self.eos_token):]
        return text


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _read_text(file: str) -> str:
    with open(file, encoding="utf-8") as f:
        return f.read()


def _read_json(file: str) -> dict:
    try:
        value = json.loads(_read_text(file))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({_one_line(e)})") from e
    if not isinstance(value, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The `*_token` entries of a tokenizer config as text (a token dict's `content`)."""
    extra = config.get("extra_special_tokens")
    entries = {**config, **(extra if isinstance(extra, Mapping) else {})}
    out = {}
    for key, value in entries.items():
        if not key.endswith("_token"):
            continue
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


# --- no template ----------------------------------------------------------------------------

_ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}


@dataclasses.dataclass(frozen=True)
class PlainFormat:
    """The prompt format of a checkpoint without a chat template.

    A lone user message is its content as is (so a dataset's prompt string is the prompt);
    anything else is each message as `Role: content`, separated by a blank line, and a
    generation prompt is `\\n\\nAssistant:`. Tools and template options have no place in it
    and are ignored.

    Examples:
      >>> PlainFormat().render([{"role": "system", "content": "Be brief."},
      ...                       {"role": "user", "content": "2+2?"}], add_generation_prompt=True)
      'System: Be brief.\\n\\nUser: 2+2?\\n\\nAssistant:'
    """

    bos_token: None = None
    eos_token: None = None

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None, **options: Any) -> str:
        """The conversation in the plain format (see the class)."""
        messages = _check_messages(messages, "plain prompt format")
        for i, m in enumerate(messages):
            if not isinstance(m.get("content"), str):
                raise ValueError(f"plain prompt format: message {i} ({m['role']}) has no text "
                                 "content; a checkpoint without a chat template takes text only")
        if len(messages) == 1 and messages[0]["role"] == "user":
            return messages[0]["content"]
        text = "\n\n".join(f"{_ROLE_NAMES.get(m['role'], m['role'].capitalize())}: {m['content']}"
                           for m in messages)
        return text + "\n\nAssistant:" if add_generation_prompt else text

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, *,
                   tools: Sequence[Mapping[str, Any]] | None = None, **options: Any) -> list[int]:
        """`render(add_generation_prompt=True)` encoded after BOS when the tokenizer has one
        (the built-in tasks' prompts start so)."""
        text = self.render(messages, add_generation_prompt=True)
        return tokenizer.encode(text, add_bos=tokenizer.bos_id is not None)

    def observation_text(self, messages: Sequence[Mapping[str, Any]], *, ended_by: str,
                         tools: Sequence[Mapping[str, Any]] | None = None, **options: Any) -> str:
        """Each message's content followed by a newline, however the turn ended."""
        _check_ended_by(ended_by)
        messages = _check_messages(messages, "plain prompt format")
        return "".join(f"{m.get('content', '')}\n" for m in messages)


ChatFormat = ChatTemplate | PlainFormat


def load_chat_format(path: str | os.PathLike,
                     say: Callable[[str], None] | None = None) -> ChatTemplate | PlainFormat:
    """A checkpoint's chat template, or `PlainFormat` (said once, in one line) when it has none.

    Args:
      path: the checkpoint directory (or its `tokenizer_config.json`).
      say: where the fallback's line goes (default: standard error).

    Returns:
      The format prompts and observations are rendered with.
    """
    template = ChatTemplate.from_pretrained(path)
    if template is not None:
        return template
    line = (f"{os.fspath(path)} has no chat template (tokenizer_config.json chat_template or "
            "chat_template.jinja): prompts use the plain format 'System: ...\\n\\nUser: ...\\n\\nAssistant:'")
    (say or (lambda s: print(s, file=sys.stderr)))(line)
    return PlainFormat()


def parse_template_options(text: str, key: str = "task.template_options") -> dict[str, Any]:
    """`k=v,...` -> a dict, each value read as JSON where it parses (`false`, `3`), else the
    string itself.

    Examples:
      >>> parse_template_options("enable_thinking=false,name=x")
      {'enable_thinking': False, 'name': 'x'}
    """
    out: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip().isidentifier():
            raise ValueError(f"{key}={text!r}: {item!r} is not NAME=VALUE (e.g. "
                             "enable_thinking=false)")
        try:
            out[name.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[name.strip()] = value
    return out
