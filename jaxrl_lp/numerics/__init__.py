"""Numerics: the precision policy, rounding, number formats and quantized matmuls.

- `policy`: `Policy`, the single place a forward pass learns its numerics.
- `rounding`: f32 -> bf16/f16 by nearest, stochastic or error-feedback rounding.
- `qarray` / `formats`: `QArray` and `quantize` / `dequantize` for FP8, MX, NVFP4,
  ternary and binary formats (`FORMATS`).
- `fingerprint`: a 64-bit identity of a pytree of arrays, on device.
- `products`: `product`, the model's products of compute-precision operands and
  their low-precision backward.

Fake quantization and `quantized_matmul` run the platform's quantize kernel,
so they live a floor up, in `jaxrl_lp.kernels.fake_quant`.
"""

from jaxrl_lp.numerics.formats import TERNARY_EPS, quantize
from jaxrl_lp.numerics.policy import (
    ALL_REGIONS,
    FP32,
    MATMUL_FORMATS,
    PRESETS,
    Policy,
    dtype_name,
    parse_dtype,
    policy_arg,
    require,
)
from jaxrl_lp.numerics.products import precision_for, product
from jaxrl_lp.numerics.qarray import FORMATS, FormatSpec, QArray, dequantize
from jaxrl_lp.numerics.rounding import error_feedback_round, round_nearest, round_stochastic, ulp

__all__ = [
    "ALL_REGIONS",
    "FORMATS",
    "FP32",
    "MATMUL_FORMATS",
    "PRESETS",
    "TERNARY_EPS",
    "FormatSpec",
    "Policy",
    "QArray",
    "dequantize",
    "dtype_name",
    "error_feedback_round",
    "parse_dtype",
    "policy_arg",
    "precision_for",
    "product",
    "quantize",
    "require",
    "round_nearest",
    "round_stochastic",
    "ulp",
]


def __getattr__(name: str):
    if name == "native_low_precision":
        raise AttributeError("jaxrl_lp.numerics.native_low_precision is gone: storage is the "
                             "policy's own field; read Policy.native (set it with s=native)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
