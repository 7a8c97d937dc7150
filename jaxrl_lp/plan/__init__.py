"""Planning a run at scale: compile its programs on N simulated devices, read memory and time.

`plan(cfg, mesh, devices, target)` (behind `jaxrl-lp plan`) lowers and
compiles a config's GRPO step and decode step at full size on abstract,
sharded inputs and reports per-device memory, FLOPs and a roofline bound on
the target accelerator (`TARGETS`). `hotpath` reads what a platform's
compiler is handed on the hot path (`jaxrl-lp bench hotpath`).
"""

from jaxrl_lp.plan.devices import rerun, simulated_env, use_simulated_devices
from jaxrl_lp.plan.hlo_cost import HloCost, hlo_cost
from jaxrl_lp.plan.hotpath import dot_summary, dots, loop_weight_reads
from jaxrl_lp.plan.planner import iteration_updates, plan
from jaxrl_lp.plan.request import GSM8K_PROMPT_TOKENS, PlanShapes, check_request
from jaxrl_lp.plan.roofline import roofline
from jaxrl_lp.plan.targets import TARGETS, Target, get_target

__all__ = [
    "GSM8K_PROMPT_TOKENS",
    "TARGETS",
    "HloCost",
    "PlanShapes",
    "Target",
    "check_request",
    "dot_summary",
    "dots",
    "get_target",
    "hlo_cost",
    "iteration_updates",
    "loop_weight_reads",
    "plan",
    "rerun",
    "roofline",
    "simulated_env",
    "use_simulated_devices",
]
