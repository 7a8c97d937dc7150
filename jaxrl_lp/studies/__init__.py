"""Numerics studies built into the library (docs/design/studies.md, "Numerics studies").

Each study drives the training program (or its learner steps) and writes JSON
and plots into a study directory; `jaxrl-lp study NAME` runs them from the
command line: fair-cast, ternary-export, alignment, backward-state,
error-diffusion, matched-precision, lora-mismatch.
"""

from jaxrl_lp.studies.alignment import run_alignment
from jaxrl_lp.studies.backward_state import run_backward_state
from jaxrl_lp.studies.error_diffusion import run_error_diffusion
from jaxrl_lp.studies.fair_cast import ARMS, arm_figures, run_fair_cast
from jaxrl_lp.studies.lora_mismatch import run_lora_mismatch
from jaxrl_lp.studies.matched_precision import run_matched_precision
from jaxrl_lp.studies.ternary_export import TERNARY_POLICY, run_ternary_export

__all__ = ["ARMS", "TERNARY_POLICY", "arm_figures", "run_alignment", "run_backward_state",
           "run_error_diffusion", "run_fair_cast", "run_lora_mismatch", "run_matched_precision",
           "run_ternary_export"]
