"""A user's own task: what a task is, data from files, chat templates, reward functions and tool
environments.

- `protocol`: the `Task` protocols the trainer reads (`SingleTurnTask`, `MultiTurnTask`,
  `SupervisedTask`, `ObservationEncoder`), `check_task` at the boundary and
  `task_fingerprint`.
- `records`: `load_records`, local JSONL / JSON / Parquet / CSV files and `datasets`
  directories, read with Hugging Face `datasets`, offline.
- `dataset`: `DatasetTask` (prompts, answers, reward functions) and `EnvDatasetTask` (with
  an environment per episode), what `task.kind=dataset` builds.
- `chat`: `ChatTemplate`, a checkpoint's own Jinja chat template rendered as `transformers`
  renders it; `PlainFormat` for a checkpoint without one.
- `rewards`: reward functions with TRL's signature (`parse_rewards`, the built-ins),
  scored on host threads with a timeout (`RewardScorer`, `RewardBatch`).
- `tools`: Hermes / Qwen `<tool_call>` parsing and `ToolEnv`, Python functions as tools.
- `imports`: `load_object("pkg.mod:name")`, how a config names a user's code.
"""

from jaxrl_lp.tasks.chat import (
    ChatTemplate,
    PlainFormat,
    as_messages,
    load_chat_format,
    parse_template_options,
)
from jaxrl_lp.tasks.dataset import DatasetTask, EnvDatasetTask, char_tokenizer_for
from jaxrl_lp.tasks.imports import load_object
from jaxrl_lp.tasks.protocol import (
    MultiTurnTask,
    ObservationEncoder,
    SingleTurnTask,
    SupervisedTask,
    Task,
    check_task,
    is_multiturn,
    task_fingerprint,
)
from jaxrl_lp.tasks.records import load_records
from jaxrl_lp.tasks.rewards import (
    BUILTIN_REWARDS,
    RewardBatch,
    RewardFunction,
    RewardScorer,
    parse_rewards,
)
from jaxrl_lp.tasks.tools import ToolCall, ToolEnv, parse_tool_calls, tool_schema

__all__ = [
    "BUILTIN_REWARDS",
    "ChatTemplate",
    "DatasetTask",
    "EnvDatasetTask",
    "MultiTurnTask",
    "ObservationEncoder",
    "PlainFormat",
    "RewardBatch",
    "RewardFunction",
    "RewardScorer",
    "SingleTurnTask",
    "SupervisedTask",
    "Task",
    "ToolCall",
    "ToolEnv",
    "as_messages",
    "char_tokenizer_for",
    "check_task",
    "is_multiturn",
    "load_chat_format",
    "load_object",
    "load_records",
    "parse_rewards",
    "parse_template_options",
    "parse_tool_calls",
    "task_fingerprint",
    "tool_schema",
]
