"""What a compiled program costs one device: memory from XLA's analysis, time from a roofline.

- `memory_figures(compiled)`: the per-device bytes of `compiled.memory_analysis()`
  (arguments, outputs, the part of the outputs that reuses donated arguments,
  temporaries, generated code) and the peak they add up to:
  `argument + output - alias + temp + generated_code`.
- `roofline(flops, bytes, target)`: a lower bound on the time of one
  execution, `max(flops / peak_flops, bytes / hbm_bandwidth)` with per-device
  FLOPs and bytes (the same as total FLOPs over `devices x peak`); which term
  binds says whether the program is compute- or memory-bound on the target.
  Communication is not in the bound (its bytes are reported beside it).
"""

from __future__ import annotations

from jaxrl_lp.plan.hlo_cost import HloCost, hlo_cost
from jaxrl_lp.plan.targets import Target

__all__ = ["cost_figures", "memory_figures", "roofline"]


def memory_figures(compiled) -> dict:
    """Per-device bytes of a compiled program (`jax.stages.Compiled`), and their peak."""
    m = compiled.memory_analysis()
    out = {
        "argument": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "alias": int(m.alias_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
        "generated_code": int(m.generated_code_size_in_bytes),
    }
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"] + \
        out["generated_code"]
    return out


def cost_figures(compiled) -> tuple[dict, HloCost]:
    """XLA's cost analysis (loop bodies counted once) and the loop-aware walk of the same program.

    Returns:
      `({"flops", "bytes_accessed"}` of `compiled.cost_analysis()`, per device,
      and the `HloCost` of `hlo_cost`).
    """
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    xla = {"flops": float(ca.get("flops", 0.0)),
           "bytes_accessed": float(ca.get("bytes accessed", 0.0))}
    return xla, hlo_cost(compiled.as_text())


def roofline(flops: float, nbytes: float, target: Target) -> dict:
    """The lower bound on one execution's time from per-device `flops` and `nbytes`.

    Returns:
      `{"compute_s", "memory_s", "time_s", "bound"}`, `bound` being `compute`
      or `memory` (the larger term).
    """
    compute, memory = flops / target.peak_flops, nbytes / target.hbm_bandwidth
    return {"compute_s": compute, "memory_s": memory, "time_s": max(compute, memory),
            "bound": "compute" if compute >= memory else "memory"}
