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
    MATMUL_FORMATS,
    PRESETS,
    Policy,
    dtype_name,
    native_low_precision,
    parse_dtype,
)
from jaxrl_lp.numerics.products import precision_for, product
from jaxrl_lp.numerics.qarray import FORMATS, FormatSpec, QArray, dequantize
from jaxrl_lp.numerics.rounding import error_feedback_round, round_nearest, round_stochastic, ulp

__all__ = [
    "ALL_REGIONS",
    "FORMATS",
    "MATMUL_FORMATS",
    "PRESETS",
    "TERNARY_EPS",
    "FormatSpec",
    "Policy",
    "QArray",
    "dequantize",
    "dtype_name",
    "error_feedback_round",
    "native_low_precision",
    "parse_dtype",
    "precision_for",
    "product",
    "quantize",
    "round_nearest",
    "round_stochastic",
    "ulp",
]
