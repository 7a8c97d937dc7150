"""Environments for multi-turn episodes: what they are, how many are stepped at once, and
the tasks that make them.

- `base`: `Environment` (reset from a record, step on a `Turn`), `StepResult`.
- `runner`: `EnvRunner`, environments stepped on host threads with a timeout; a
  failing one ends its episode with a recorded reason.
- `calculator`: `CalculatorTask`, the embedded multi-turn task (arithmetic with a
  calculator tool).
- `python_calculator`: `PythonCalculatorTask`, GSM8K-format records with a
  Python-expression calculator, for real checkpoints.
"""

from jaxrl_lp.envs.base import ENDINGS, Environment, StepResult, Turn
from jaxrl_lp.envs.calculator import (
    CalculatorEnv,
    CalculatorSplit,
    CalculatorTask,
    evaluate_expression,
)
from jaxrl_lp.envs.python_calculator import PythonCalculatorEnv, PythonCalculatorTask, safe_eval
from jaxrl_lp.envs.runner import EnvRunner

__all__ = [
    "ENDINGS",
    "CalculatorEnv",
    "CalculatorSplit",
    "CalculatorTask",
    "EnvRunner",
    "Environment",
    "PythonCalculatorEnv",
    "PythonCalculatorTask",
    "StepResult",
    "Turn",
    "evaluate_expression",
    "safe_eval",
]
