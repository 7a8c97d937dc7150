"""Numerics studies built into the library (SPEC section 7): Fair Cast and ternary export.

Each study drives the training program and writes JSON and plots into a study
directory; `jaxrl-lp study fair-cast|ternary-export` runs them from the command line.
"""

from jaxrl_lp.studies.fair_cast import ARMS, arm_figures, run_fair_cast
from jaxrl_lp.studies.ternary_export import TERNARY_POLICY, run_ternary_export

__all__ = ["ARMS", "TERNARY_POLICY", "arm_figures", "run_fair_cast", "run_ternary_export"]
