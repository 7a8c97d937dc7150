"""Tool calls in the Hermes / Qwen format, and an environment that answers them with Python
functions.

A model trained on Qwen2.5 or Qwen3's chat template calls a tool by writing

    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call>

and reads the result as a tool message, which the template renders (Qwen3:
`<|im_start|>user\\n<tool_response>\\n5\\n</tool_response><|im_end|>\\n`). A turn ends on
the `</tool_call>` token (a stop token of the task), `parse_tool_calls` reads the calls
from its text, `ToolEnv` runs them and answers with one tool message per call
(`envs.StepResult.messages`); the task renders the messages with its chat template
(`tasks.EnvDatasetTask.observation_ids`), so the context is extended token by token and
never re-tokenized. `tool_schema` describes a function as the templates' `tools=`
argument expects (the JSON schema `transformers.utils.get_json_schema` writes, from the
signature's annotations).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxrl_lp.envs.base import StepResult, Turn

__all__ = ["ToolCall", "ToolEnv", "parse_tool_calls", "tool_schema"]

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array",
               dict: "object"}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments."""

    name: str
    arguments: Mapping[str, Any]


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The calls in `text` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as
    many as it holds), and what was wrong with each block that is not one.

    Returns:
      `(calls, errors)`: the well-formed calls in order, and one message per malformed
      block (not JSON, no `name`, `arguments` not an object).

    Examples:
      >>> parse_tool_calls('x <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
      ([ToolCall(name='add', arguments={'a': 1})], [])
    """
    calls, errors = [], []
    for block in _CALL.findall(text):
        try:
            obj = json.loads(block)
        except json.JSONDecodeError as e:
            errors.append(f"not JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append('a call is {"name": ..., "arguments": {...}}')
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            errors.append(f"the arguments of {obj['name']!r} are not an object")
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls, errors


def tool_schema(fn: Callable) -> dict:
    """A function as a chat template's tool: its name, its docstring's first paragraph and
    its parameters' JSON types (from the annotations; a parameter without a default is
    required).

    Examples:
      >>> def add(a: int, b: int) -> int:
      ...     "Adds two integers."
      ...     return a + b
      >>> tool_schema(add)["function"]["parameters"]["required"]
      ['a', 'b']
    """
    if not callable(fn) or not getattr(fn, "__name__", None):
        raise ValueError(f"tool_schema: {fn!r} is not a named function")
    hints = {}
    try:
        import typing

        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: the parameters are untyped
        pass
    props, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        props[name] = {"type": _JSON_TYPES.get(hints.get(name), "string")}
        if p.default is p.empty:
            required.append(name)
    doc = inspect.getdoc(fn) or ""
    return {"type": "function", "function": {
        "name": fn.__name__, "description": doc.split("\n\n")[0].replace("\n", " "),
        "parameters": {"type": "object", "properties": props, "required": required}}}


def _show(value: Any) -> str:
    """A tool's result as the text of its message (strings as they are, the rest as JSON)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


class ToolEnv:
    """An episode in which the model calls Python functions (module docstring).

    A turn that stops on `</tool_call>` is read for calls; each runs (`fn(**arguments)`)
    and is answered by a tool message with its result, or with `error: ...` (an unknown
    tool, bad arguments, the function raised: the model reads the error and may try
    again). A turn that ends with EOS ends the episode (the task's reward functions
    score it); one cut by the token limit ends it, `truncated`. The environment's own
    rewards are 0.

    Every result's `info` holds `tool_call` (the turn called tools), `tool_calls` (the
    episode's calls so far) and, on a call, `tool_ok` (every call ran) and `tool_error`.

    Args:
      tools: the functions, by their `__name__` (a sequence) or by name (a mapping).

    Examples:
      >>> env = ToolEnv([add]); env.reset({"prompt": "2+3?"})
      >>> env.step(Turn((), '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}'
      ...               '</tool_call>', "stop")).messages
      ({'role': 'tool', 'content': '5'},)
    """

    def __init__(self, tools: Sequence[Callable] | Mapping[str, Callable]):
        self.tools = dict(tools) if isinstance(tools, Mapping) else {f.__name__: f for f in tools}
        if not self.tools or not all(callable(f) for f in self.tools.values()):
            raise ValueError(f"ToolEnv: tools={tools!r} must be one or more functions")
        self.record, self.calls = None, 0

    def reset(self, record: Any) -> None:
        """Starts an episode (the task renders the record's prompt)."""
        self.record, self.calls = record, 0

    def _run(self, call: ToolCall) -> tuple[str, str | None]:
        fn = self.tools.get(call.name)
        if fn is None:
            return f"error: no tool {call.name!r} (tools: {sorted(self.tools)})", "unknown tool"
        try:
            return _show(fn(**call.arguments)), None
        except Exception as e:  # noqa: BLE001 - a tool's failure is the model's to read
            why = f"{type(e).__name__}: {e}"[:200]
            return f"error: {why}", why

    def step(self, turn: Turn) -> StepResult:
        info: dict[str, Any] = {"tool_call": False, "tool_calls": self.calls}
        if turn.ended_by != "stop":
            return StepResult(done=True, info={**info, "truncated": turn.ended_by == "length"})
        calls, errors = parse_tool_calls(turn.text)
        messages, failures = [], list(errors)
        for call in calls:
            content, error = self._run(call)
            messages.append({"role": "tool", "content": content})
            failures += [error] if error else []
        messages += [{"role": "tool", "content": f"error: {e}"} for e in errors]
        if not messages:
            failures.append("no <tool_call>{...}</tool_call> in the turn")
            messages.append({"role": "tool", "content": f"error: {failures[-1]}"})
        self.calls += len(calls)
        info = {"tool_call": True, "tool_calls": self.calls, "tool_ok": not failures}
        if failures:
            info["tool_error"] = failures[0]
        return StepResult(messages=tuple(messages), info=info)
