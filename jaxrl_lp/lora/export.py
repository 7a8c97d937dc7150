"""The merged served copy of a LoRA run: `W + A B alpha/r`, rounded to the served format.

With `lora.serve=merged` the sampler runs one dense weight per matmul, as an
inference engine serving a merged LoRA checkpoint does. `merged_exporter(inner)`
is an `Exporter` (`sync.export`) whose `apply` merges the LoRA forward tree
(`models.lora.merge_adapters`: the f32 product of the adapters added to the
f32 base, one rounding) and then applies `inner`, which rounds or quantizes it
to the served format (`sync.exporter`, or the base's own format:
`served_format_exporter`). Its state is `inner`'s (e.g. error-feedback
residuals of the merged weights), checkpointed with the run's sync state.

With `sync.loss_on_served` the learner computes its loss on that copy,
`sg(served) + (merged - sg(merged))` (`sync.export.straight_through_served`,
which merges a LoRA tree first), so the gradient reaches the adapters through
the merge and the replay of the served copy is the sampler's computation.
"""

from __future__ import annotations

from jaxrl_lp.models.lora import merge_adapters
from jaxrl_lp.sync.export import EmptyState, Exporter, cast, quantize

__all__ = ["merged_exporter", "served_format_exporter"]


def served_format_exporter(base_format: str) -> Exporter | None:
    """The exporter that rounds a merged copy back to the base's own format: none for f32
    (the f32 merge is served), round to nearest for bf16, the format's quantizer otherwise."""
    if base_format == "f32":
        return None
    if base_format == "bf16":
        return cast("bf16", "nearest")
    return quantize(base_format)


def merged_exporter(inner: Exporter | None) -> Exporter:
    """An exporter of LoRA forward trees: merge (module docstring), then `inner` (or nothing).

    Examples:
      >>> ex = merged_exporter(quantize("nvfp4"))
      >>> served, state = ex.apply(with_adapters(base, adapters, 2.0), ex.init(view))
    """

    def init(params):
        return EmptyState() if inner is None else inner.init(merge_adapters(params))

    def apply(params, state, version=None):
        merged = merge_adapters(params)
        if inner is None:
            return merged, state
        return inner.apply(merged, state, version)

    return Exporter(init, apply)
