"""Weight export and sync between the f32 learner and the low-precision sampler.

The design: docs/design/sync.md, "Weight export and sync".

- `export`: exporters as optax-style transforms (`cast`, `quantize`, `chain`;
  `Exporter(init, apply)`), `served_params_for_forward` and the Fair Cast
  `straight_through_served`.
- `ternary`: the three ternary export paths and `code_disagreement`.
- `layout`: tensor names, layouts (`TensorSpec`) and byte hashes of served trees.
- `checks`: the seven sync checks and `run_sync_checks` -> `SyncReport`; `probe`: check 7
  and `probe_logprobs`; `report`: `CheckResult`, `SyncReport`, `SamplerState`.
- `diagnostics`: update retention, staleness, ulp distance, KL, served progress.
- `served_io`: the served copy on disk (`write_served`, `read_served`; docs/served_layout.md).
"""

from jaxrl_lp.sync.checks import (
    CHECK_NAMES,
    check_hashes,
    check_layout,
    check_requantize_fixed_point,
    check_scales,
    check_unquantized_exact,
    check_version,
    expected_layout,
    run_sync_checks,
)
from jaxrl_lp.sync.diagnostics import (
    LAG_THRESHOLD,
    ProgressState,
    StalenessState,
    kl_from_logits,
    kl_from_logprobs,
    progress_init,
    progress_update,
    served_progress,
    served_ulp,
    staleness_init,
    staleness_update,
    ulp_distance,
    update_retention,
)
from jaxrl_lp.sync.export import (
    ROUNDINGS,
    CastState,
    EmptyState,
    ErrorFeedbackState,
    Exporter,
    cast,
    chain,
    quantize,
    served_params_for_forward,
    straight_through_served,
)
from jaxrl_lp.sync.layout import (
    MATMUL_WEIGHTS,
    TensorSpec,
    flatten_served,
    hash_served,
    layout_of,
    matmul_weight_paths,
)
from jaxrl_lp.sync.probe import PROBE_ATOL, check_probe_logprobs, probe_logprobs
from jaxrl_lp.sync.report import CheckResult, SamplerState, SyncReport
from jaxrl_lp.sync.served_io import quantization_config, read_served, write_served
from jaxrl_lp.sync.ternary import (
    TERNARY_PATHS,
    code_disagreement,
    legacy_ternary_quantize,
    ternary,
    ternary_fixed_point,
)

__all__ = [
    "CHECK_NAMES",
    "LAG_THRESHOLD",
    "MATMUL_WEIGHTS",
    "PROBE_ATOL",
    "ROUNDINGS",
    "TERNARY_PATHS",
    "CastState",
    "CheckResult",
    "EmptyState",
    "ErrorFeedbackState",
    "Exporter",
    "ProgressState",
    "SamplerState",
    "StalenessState",
    "SyncReport",
    "TensorSpec",
    "cast",
    "chain",
    "check_hashes",
    "check_layout",
    "check_probe_logprobs",
    "check_requantize_fixed_point",
    "check_scales",
    "check_unquantized_exact",
    "check_version",
    "code_disagreement",
    "expected_layout",
    "flatten_served",
    "hash_served",
    "kl_from_logits",
    "kl_from_logprobs",
    "layout_of",
    "legacy_ternary_quantize",
    "matmul_weight_paths",
    "probe_logprobs",
    "progress_init",
    "progress_update",
    "quantization_config",
    "quantize",
    "read_served",
    "run_sync_checks",
    "served_params_for_forward",
    "served_progress",
    "served_ulp",
    "staleness_init",
    "staleness_update",
    "straight_through_served",
    "ternary",
    "ternary_fixed_point",
    "ulp_distance",
    "update_retention",
    "write_served",
]
