"""The task a run trains: built from its config's `task` section, or a user's object, checked
at the boundary, and recorded in the run directory so a resumed run refuses another task.

`build_task(cfg, task)` returns `task` itself when one is given (`run_train(cfg,
task=...)`, a config file's `TASK`), else the task of `cfg.task`: a built-in task, or
`task.kind=dataset` (`tasks.DatasetTask` over `task.path`, its reward functions, the
chat template of `init_from` and, with `task.env` or `task.tools`, an environment). Either
way `tasks.check_task` names what an object lacks before anything is written.

A run records its task in `task.json` (`TaskRecord`: the fingerprint, the type and the
config file that defined it, if any); resuming it with another task is one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from jaxrl_lp.tasks.protocol import check_task, task_fingerprint
from jaxrl_lp.train.config import TrainConfig

__all__ = ["TASK_FILE", "TaskRecord", "build_task", "check_task_record", "dataset_task"]

TASK_FILE = "task.json"


def _named(key: str, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, with any error it raises on bad input named by `key`."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, OSError, TypeError) as e:
        text = " ".join(str(e).split())
        raise ValueError(text if text.startswith(key) else f"{key}: {text}") from None


def _tokenizer(cfg: TrainConfig):
    """`init_from`'s tokenizer (its `tokenizer.json`)."""
    from jaxrl_lp.models.tokenizer import HFTokenizer

    try:
        return HFTokenizer.from_file(cfg.init_from)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exception
        raise ValueError(f"init_from: cannot read its tokenizer ({' '.join(str(e).split())})") \
            from None


_SAID_PLAIN: set[str] = set()


def _template(cfg: TrainConfig):
    """The chat template prompts are rendered with: `init_from`'s (task.chat_template=auto),
    or None (the plain format; said once per checkpoint when it has no template)."""
    if cfg.task.chat_template == "none" or not cfg.init_from:
        return None
    from jaxrl_lp.tasks.chat import ChatTemplate

    template = _named("init_from", ChatTemplate.from_pretrained, cfg.init_from)
    if template is None and cfg.init_from not in _SAID_PLAIN:
        _SAID_PLAIN.add(cfg.init_from)
        print(f"jaxrl-lp: {cfg.init_from} has no chat template (tokenizer_config.json "
              "chat_template): prompts use the plain format, the prompt's text after BOS",
              file=sys.stderr)
    return template


def dataset_task(cfg: TrainConfig):
    """The `tasks.DatasetTask` (or `EnvDatasetTask`) of `task.kind=dataset`."""
    from jaxrl_lp.tasks.chat import parse_template_options
    from jaxrl_lp.tasks.dataset import DatasetTask, EnvDatasetTask, char_tokenizer_for
    from jaxrl_lp.tasks.records import load_records, prompt_key_text
    from jaxrl_lp.tasks.rewards import parse_rewards

    t, g = cfg.task, cfg.grpo
    splits = load_records(t.path, "task.path")
    train = splits.get("train") or next(iter(splits.values()))
    heldout = None
    if t.heldout:
        held = load_records(t.heldout, "task.heldout")
        heldout = held.get("test") or held.get("train") or next(iter(held.values()))
    elif "test" in splits and "train" in splits:
        heldout = splits["test"]
    rewards = _named("task.rewards", parse_rewards, t.rewards or (
        "" if t.multiturn else "exact_match"), "task.rewards", format_regex=t.format_regex)
    template = _template(cfg)
    if cfg.init_from:
        tok = _tokenizer(cfg)
    else:  # a small model from scratch: one id per character of the data
        records = [*train, *(heldout or ())]
        texts = [prompt_key_text(r[t.prompt_key]) if t.prompt_key in r else "" for r in records]
        for key in (t.answer_key, t.completion_key):
            texts += [str(r.get(key, "")) for r in records] if key else []
        texts += [t.system_prompt, t.stop]
        tok = char_tokenizer_for(texts)
    for key in ("answer_key", "completion_key"):
        column = getattr(t, key)
        if column and column not in train[0]:
            raise ValueError(f"task.{key}={column!r}: the records of {t.path} have no such column "
                             f"(columns: {sorted(train[0])}); set task.{key} to one of them, or ''")
    kw = dict(records=train, tokenizer=tok, reward_functions=rewards, heldout_records=heldout,
              prompt_key=t.prompt_key, answer_key=t.answer_key, completion_key=t.completion_key,
              template=template, system_prompt=t.system_prompt,
              template_options=parse_template_options(t.template_options),
              heldout_fraction=t.heldout_fraction, reward_timeout_s=t.reward_timeout_s,
              failure_reward=t.failure_reward, completion_budget=g.max_new_tokens)
    if not t.multiturn:
        return _named("task", DatasetTask, **kw)
    from jaxrl_lp.tasks.imports import load_object

    stop = tuple(s for s in t.stop.split(",") if s) if t.stop else ()
    tools = ()
    if t.tools:
        from jaxrl_lp.tasks.tools import ToolEnv, tool_schema

        functions = [load_object(spec, "task.tools") for spec in t.tools.split(",") if spec]
        tools = tuple(tool_schema(f) for f in functions)
        factory = lambda: ToolEnv(functions)
        stop = stop or ("</tool_call>",)
    else:
        factory = load_object(t.env, "task.env")
        if not callable(factory):
            raise ValueError(f"task.env={t.env!r} is a {type(factory).__name__}, not a factory: "
                             "name a function or class that makes one environment")
    if not stop and template is not None:
        stop = ("</tool_call>",)
    for s in stop:
        if len(tok.encode(s)) != 1:
            raise ValueError(f"task.stop={t.stop!r}: {s!r} is {len(tok.encode(s))} tokens of the "
                             "tokenizer; a turn ends on one token: give strings that are single "
                             "tokens (a special token such as </tool_call>)")
    return _named("task", EnvDatasetTask, **kw, env_factory=factory, max_turns=t.max_turns,
                  max_turn_tokens=t.max_turn_tokens or g.max_new_tokens or 128,
                  max_observation_tokens=t.max_observation_tokens, stop=stop, tools=tools)


def _builtin_task(cfg: TrainConfig):
    """A built-in task of `cfg.task` (a GSM8K task reads its file and `init_from`'s tokenizer)."""
    from jaxrl_lp.data import ArithmeticTask, GSM8KTask, load_gsm8k

    t = cfg.task
    if t.kind == "arithmetic":
        return _named("task", ArithmeticTask, ops=t.ops, max_digits=t.max_digits, seed=t.seed,
                      reverse_answer=t.reverse_answer, pad_operands=t.pad_operands)
    if t.kind == "calculator":
        from jaxrl_lp.envs import CalculatorTask

        return _named("task", CalculatorTask, ops=t.ops, digits=(t.max_digits, t.second_digits),
                      seed=t.seed, tool_fraction=t.tool_fraction, max_turns=t.max_turns)
    if t.kind == "dataset":
        return dataset_task(cfg)
    if not cfg.init_from:
        raise ValueError(f"task.kind={t.kind!r} needs init_from=<HF checkpoint dir with "
                         "tokenizer.json>")
    records = _named("task.path", load_gsm8k, t.path)
    base = _named("task", GSM8KTask, records, _tokenizer(cfg))
    if t.kind == "gsm8k_tools":
        from jaxrl_lp.envs import PythonCalculatorTask

        return _named("task", PythonCalculatorTask, base, max_turns=t.max_turns,
                      max_turn_tokens=cfg.grpo.max_new_tokens or 128)
    return base


def build_task(cfg: TrainConfig, task: Any = None, *, key: str = "task") -> Any:
    """The run's task: `task` when given, else the one `cfg.task` describes; checked
    (`tasks.check_task`, the warm-start's `sft_example` when `sft.steps > 0`).

    Raises:
      ValueError: one line: the config's task cannot be built, or the object lacks what a
        task provides.
    """
    if cfg.init_from and not os.path.isdir(cfg.init_from):
        raise ValueError(f"init_from={cfg.init_from!r} is not a directory; pass a Hugging Face "
                         "checkpoint directory (config.json + model.safetensors) or ''")
    if task is None:
        task = _builtin_task(cfg)
    return check_task(task, needs_sft=cfg.sft.steps > 0, key=key)


@dataclasses.dataclass(frozen=True)
class TaskRecord:
    """What a run directory records of its task (`task.json`).

    Attributes:
      fingerprint: `tasks.task_fingerprint` of the task.
      type: the task's class, `module.QualName`.
      config_file: the config file that defined the task as `TASK`, if one did (what
        `jaxrl-lp eval --run` loads it from), else ''.
    """

    fingerprint: str
    type: str
    config_file: str = ""

    @classmethod
    def of(cls, task: Any, config_file: str = "") -> TaskRecord:
        return cls(task_fingerprint(task), f"{type(task).__module__}.{type(task).__qualname__}",
                   os.path.abspath(config_file) if config_file else "")

    @classmethod
    def read(cls, run_dir: str | os.PathLike) -> TaskRecord | None:
        """The record of the run in `run_dir`, or None (a new run, or one from before it)."""
        path = Path(run_dir) / TASK_FILE
        if not path.is_file():
            return None
        return cls(**json.loads(path.read_text()))

    def write(self, run_dir: str | os.PathLike) -> None:
        """Writes `task.json` atomically."""
        path = Path(run_dir) / TASK_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")
        tmp.replace(path)


def check_task_record(run_dir: str | os.PathLike, record: TaskRecord) -> None:
    """Raises where the run in `run_dir` was started with another task than `record`'s."""
    saved = TaskRecord.read(run_dir)
    if saved is None or saved.fingerprint == record.fingerprint:
        return
    raise ValueError(
        f"the run in {run_dir} trains another task ({saved.type}, fingerprint "
        f"{saved.fingerprint}) than this one ({record.type}, fingerprint {record.fingerprint}): "
        "other data, tokenizer, rewards or limits. Resume it with the task it started with, "
        "or train into another run.out_dir")
