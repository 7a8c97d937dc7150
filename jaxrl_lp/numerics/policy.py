"""The precision policy: the single place where a forward pass learns its numerics.

A `Policy` names the dtype of every value a forward pass touches and the places
where values are rounded. The sampler and the learner each hold one; they are
"matched" when the two policies are equal.

Rounding sites. Every activation that crosses from one region of the network
to the next is rounded to `compute_dtype` (`Policy.round`). Inside an
*f32 region* (`f32_regions`) the computation runs in f32 from the region's
inputs to its output and is rounded once, at the output. Leaving a region out
reproduces where a typical inference kernel rounds (bf16 RoPE, a bf16 residual
stream, bf16 silu*u), which is how the mismatch those kernels cause is studied.

Carrying low precision on CPU (docs/design/low_precision.md, "Performance on the development
CPUs"). XLA's bf16 matmuls on CPU are several times slower than f32. Products
of two bf16 (or fp16) values are exact in f32 and accumulation is f32 either
way, so on CPU a low-precision compute dtype is *carried* as f32 arrays holding
values rounded to the compute dtype: every rounding site still rounds (x ->
bf16 -> f32), only the storage differs.
On GPU and TPU the values are stored in the compute dtype itself. Which storage
a program uses is the policy's `storage` field: `auto` (native where the program
is traced for a GPU or TPU backend, the f32 carrier on CPU), `native` or `f32`
(forced, for example to trace a GPU program on CPU). Both the sampler and the
learner call the same functions with their policy, so they take the same path.

Typed inside, strings at the edge: a policy string is parsed once where it
enters (a config's `policies`, a command's `policy_arg`, a checkpoint's or a
rollout file's metadata) and travels as a `Policy`. Functions below take the
object and refuse a string with one line naming `Policy.parse` (`require`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

__all__ = [
    "ALL_REGIONS",
    "FP32",
    "KERNEL_MODES",
    "PRESETS",
    "Policy",
    "Region",
    "STORAGE_MODES",
    "dtype_name",
    "parse_dtype",
    "policy_arg",
    "policy_list_arg",
    "require",
]

if "JAXRL_LP_NATIVE_LOW_PRECISION" in os.environ:
    raise RuntimeError("JAXRL_LP_NATIVE_LOW_PRECISION is no longer read: storage is part of the "
                       "policy; unset it and add s=native (or s=f32) to the policy string")

Region = Literal["rope", "swiglu", "norm", "residual", "softmax"]
# The non-matmul regions a policy may keep in f32 (`f32=rope+norm+...`).
ALL_REGIONS: tuple[str, ...] = ("rope", "swiglu", "norm", "residual", "softmax")
BACKWARD_MODES: tuple[str, ...] = ("reuse", "fresh")
# Where the Pallas kernels of `jaxrl_lp.kernels` run (`kernels.dispatch`, resolved for
# the platform a program is lowered for): `auto` (the kernel where that platform
# compiles it, the jnp reference elsewhere), `on` (the kernel, an error where it
# cannot run), `off` (the reference), `interpret` / `interpret-tpu` (the GPU / TPU
# version in Pallas interpret mode: for checking kernels on CPU).
KERNEL_MODES: tuple[str, ...] = ("auto", "on", "off", "interpret", "interpret-tpu")
# How arrays of a low-precision compute dtype are stored (module docstring): `auto` by the
# backend a program is traced for, `native` in the compute dtype, `f32` in the f32 carrier.
STORAGE_MODES: tuple[str, ...] = ("auto", "native", "f32")
# Number formats a policy may apply to matmul operands (docs/design/low_precision.md, "Number formats").
MATMUL_FORMATS: tuple[str, ...] = (
    "fp8",  # per-tensor E4M3
    "fp8_e5m2",
    "mxfp8",
    "mxfp4",
    "nvfp4",
    "ternary",
    "binary",
)

_DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype(np.float32),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f16": np.dtype(np.float16),
}
_ALIASES = {
    "float32": "f32",
    "fp32": "f32",
    "bfloat16": "bf16",
    "float16": "f16",
    "fp16": "f16",
    "half": "f16",
}


def parse_dtype(name: Any, field: str = "dtype") -> np.dtype:
    """Returns the numpy dtype for a short name (`f32`, `bf16`, `f16`) or a dtype."""
    if isinstance(name, str):
        key = _ALIASES.get(name, name)
        if key not in _DTYPES:
            raise ValueError(
                f"Policy field {field!r}: unknown dtype {name!r}; allowed: {sorted(_DTYPES)}"
            )
        return _DTYPES[key]
    dt = np.dtype(name)
    if dt not in _DTYPES.values():
        raise ValueError(
            f"Policy field {field!r}: dtype {dt} is not supported; allowed: {sorted(_DTYPES)}"
        )
    return dt


def dtype_name(dt: Any) -> str:
    """The short name of a supported dtype (`f32`, `bf16`, `f16`)."""
    dt = np.dtype(dt)
    for k, v in _DTYPES.items():
        if v == dt:
            return k
    raise ValueError(f"unsupported dtype {dt}")


@dataclasses.dataclass(frozen=True, repr=False)
class Policy:
    """Numerics of one forward pass.

    Attributes:
      param_dtype: dtype the weights are held in for this forward. Weights are
        rounded (round to nearest even) to it before use; learner master weights
        are f32, a served copy may be bf16/f16 (rounded by the exporter).
      compute_dtype: dtype of matmul inputs and of activations between regions.
      accum_dtype: matmul accumulation (`preferred_element_type`).
      logits_dtype: dtype the logits are rounded to; log-probs are always f32.
      f32_regions: regions computed in f32 from inputs to output, rounded once
        at the output (see module docstring and `ALL_REGIONS`).
      matmul_format: `None` or a number format (`MATMUL_FORMATS`) applied to
        matmul weights (and activations where the format says so), with
        straight-through gradients.
      backward: `reuse` (backward reads the forward's rounded operands) or
        `fresh` (backward re-quantizes the saved high-precision operands).
      kernels: where the hot-path kernels run (`KERNEL_MODES`): part of the
        policy because a kernel rounds where its tiles end, so the sampler and
        the learner must make the same choice to agree bit for bit.
      storage: how a low-precision compute dtype is stored (`STORAGE_MODES`):
        `auto` natively on a GPU or TPU backend and in the f32 carrier on CPU,
        or forced `native` / `f32`. The rounded values are the same; the
        programs differ, so the sampler and the learner share the choice.

    Examples:
      >>> p = Policy.parse("bf16")
      >>> Policy.parse(str(p)) == p
      True
    """

    param_dtype: np.dtype = _DTYPES["f32"]
    compute_dtype: np.dtype = _DTYPES["f32"]
    accum_dtype: np.dtype = _DTYPES["f32"]
    logits_dtype: np.dtype = _DTYPES["f32"]
    f32_regions: frozenset[str] = frozenset(ALL_REGIONS)
    matmul_format: str | None = None
    backward: str = "reuse"
    kernels: str = "auto"
    storage: str = "auto"

    def __post_init__(self):
        for f in ("param_dtype", "compute_dtype", "accum_dtype", "logits_dtype"):
            object.__setattr__(self, f, parse_dtype(getattr(self, f), f))
        regions = self.f32_regions
        if isinstance(regions, str):
            regions = [r for r in regions.split("+") if r]
        regions = frozenset(regions)
        unknown = regions - set(ALL_REGIONS)
        if unknown:
            raise ValueError(
                f"Policy field 'f32_regions': unknown region(s) {sorted(unknown)}; "
                f"allowed: {list(ALL_REGIONS)}"
            )
        object.__setattr__(self, "f32_regions", regions)
        if self.accum_dtype != _DTYPES["f32"]:
            raise ValueError("Policy field 'accum_dtype': only f32 accumulation is supported")
        if self.matmul_format is not None and self.matmul_format not in MATMUL_FORMATS:
            raise ValueError(
                f"Policy field 'matmul_format': unknown format {self.matmul_format!r}; "
                f"allowed: None or one of {list(MATMUL_FORMATS)}"
            )
        if self.backward not in BACKWARD_MODES:
            raise ValueError(
                f"Policy field 'backward': {self.backward!r} is not one of {list(BACKWARD_MODES)}"
            )
        if self.kernels not in KERNEL_MODES:
            raise ValueError(
                f"Policy field 'kernels': {self.kernels!r} is not one of {list(KERNEL_MODES)}"
            )
        if self.storage not in STORAGE_MODES:
            raise ValueError(
                f"Policy field 'storage': {self.storage!r} is not one of {list(STORAGE_MODES)}"
            )

    # ----------------------------------------------------------------- string form
    def __str__(self) -> str:
        parts = [f"p={dtype_name(self.param_dtype)}", f"c={dtype_name(self.compute_dtype)}"]
        if self.logits_dtype != _DTYPES["f32"]:
            parts.append(f"l={dtype_name(self.logits_dtype)}")
        parts.append(f"mm={self.matmul_format or 'none'}")
        parts.append(f"bwd={self.backward}")
        regions = [r for r in ALL_REGIONS if r in self.f32_regions]
        parts.append(f"f32={'+'.join(regions) if regions else 'none'}")
        if self.kernels != "auto":  # defaults are left out: older strings stay valid
            parts.append(f"k={self.kernels}")
        if self.storage != "auto":
            parts.append(f"s={self.storage}")
        return ",".join(parts)

    @property
    def name(self) -> str:
        """The preset name if the policy is one (`bf16`), else the string form."""
        for name, preset in PRESETS.items():
            if preset == self:
                return name
        return str(self)

    def __repr__(self) -> str:
        return f"Policy.parse({str(self)!r})"

    def to_string(self) -> str:
        """The short string form; `Policy.parse(p.to_string()) == p`."""
        return str(self)

    @classmethod
    def parse(cls, spec: str | Policy) -> Policy:
        """Parses a preset name (`fp32`, `bf16`, ...) or the string form of `__str__`.

        Keys: `p` (param dtype), `c` (compute), `a` (accum), `l` (logits),
        `mm` (matmul format or `none`), `bwd` (`reuse`/`fresh`), `f32`
        (regions joined by `+`, or `none`), `k` (kernels: `auto`, `on`, `off`,
        `interpret`, `interpret-tpu`), `s` (storage: `auto`, `native`, `f32`). Unnamed
        keys take their defaults. A preset name may be followed by overrides:
        `bf16,k=interpret`.
        """
        if isinstance(spec, Policy):
            return spec
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"policy must be a preset name or a string like 'p=f32,c=bf16'; got {spec!r}")
        spec = spec.strip()
        if spec in PRESETS:
            return PRESETS[spec]
        head, _, rest = spec.partition(",")
        if head in PRESETS and rest:
            return cls.parse(f"{PRESETS[head]},{rest}")
        if "=" not in spec:
            raise ValueError(
                f"unknown policy {spec!r}: not a preset ({sorted(PRESETS)}) and not of the "
                "form 'p=f32,c=bf16,mm=none,bwd=reuse,f32=rope+norm'"
            )
        keys = {"p": "param_dtype", "c": "compute_dtype", "a": "accum_dtype", "l": "logits_dtype",
                "mm": "matmul_format", "bwd": "backward", "f32": "f32_regions",
                "k": "kernels", "s": "storage"}
        kwargs: dict[str, Any] = {}
        for item in spec.split(","):
            if "=" not in item:
                raise ValueError(f"policy {spec!r}: item {item!r} is not key=value")
            k, v = (s.strip() for s in item.split("=", 1))
            if k not in keys:
                raise ValueError(f"policy {spec!r}: unknown key {k!r}; allowed: {sorted(keys)}")
            if k == "mm":
                v = None if v in ("none", "") else v
            if k == "f32":
                v = frozenset() if v == "none" else frozenset(r for r in v.split("+") if r)
            kwargs[keys[k]] = v
        return cls(**kwargs)

    def replace(self, **changes) -> Policy:
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------- numerics
    def has(self, region: str) -> bool:
        """Whether `region` is computed in f32 (see `ALL_REGIONS`)."""
        return region in self.f32_regions

    @property
    def is_low_precision(self) -> bool:
        return self.compute_dtype != _DTYPES["f32"]

    @property
    def native(self) -> bool:
        """Whether a low-precision compute dtype is stored natively (`storage`), for the
        backend a program is traced for now when `storage` is `auto`."""
        if self.storage == "auto":
            return jax.default_backend() != "cpu"
        return self.storage == "native"

    @property
    def carrier_dtype(self) -> np.dtype:
        """The dtype arrays of compute precision are stored in (see module docstring)."""
        if self.is_low_precision and self.native:
            return self.compute_dtype
        return _DTYPES["f32"]

    def round(self, x: jax.Array) -> jax.Array:
        """Rounds `x` to `compute_dtype` (round to nearest even); returns the carrier dtype."""
        return _round_to(x, self.compute_dtype, self.carrier_dtype)

    def round_params(self, w: jax.Array) -> jax.Array:
        """Rounds a weight to `param_dtype` then to `compute_dtype` (the matmul input)."""
        if (w.dtype == self.compute_dtype == self.carrier_dtype
                and self.param_dtype in (_DTYPES["f32"], self.compute_dtype)):
            return w  # the matmul input already (`models.blocks.decode_weights`): nothing to round
        if w.dtype != self.param_dtype:
            w = w.astype(self.param_dtype)
        return self.round(w)

    def round_logits(self, x: jax.Array) -> jax.Array:
        """Rounds f32 logits to `logits_dtype`, returned in f32."""
        return _round_to(x, self.logits_dtype, _DTYPES["f32"])

    def cast_params(self, tree: Any) -> Any:
        """Casts floating leaves of a pytree to `param_dtype` (ids and masks pass through)."""
        def cast(x):
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
                return jnp.asarray(x).astype(self.param_dtype)
            return x
        return jax.tree.map(cast, tree)


def require(policy: Any, where: str) -> Policy:
    """`policy` if it is a `Policy`; a string or anything else raises one line naming the fix."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        raise TypeError(f"{where}: the policy is the string {policy!r}; pass a Policy, parsed "
                        f"once where the string enters: Policy.parse({policy!r})")
    raise TypeError(f"{where}: policy must be a Policy; got {type(policy).__name__}")


def policy_arg(text: str) -> Policy:
    """An argparse `type`: a policy string parsed at the command line."""
    try:
        return Policy.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def policy_list_arg(text: str) -> tuple[Policy, ...]:
    """An argparse `type`: comma-separated preset names (`bf16,fp32`), or policies of any
    form separated by semicolons (`fp8;fp8,bwd=fresh`: a policy string holds commas), each
    parsed. A comma-separated item that is no preset is refused: `fp8,bwd=fresh` would
    otherwise read as two policies."""
    if ";" in text:
        return tuple(policy_arg(p) for p in text.split(";") if p)
    for p in text.split(","):
        if p and p not in PRESETS:
            raise argparse.ArgumentTypeError(
                f"{p!r} in {text!r} is no preset ({', '.join(sorted(PRESETS))}); separate "
                "policies of any form by ';', e.g. 'fp8;fp8,bwd=fresh'")
    return tuple(policy_arg(p) for p in text.split(",") if p)


def _round_to(x: jax.Array, dtype: np.dtype, carrier: np.dtype) -> jax.Array:
    if x.dtype == dtype and carrier == dtype:
        return x
    if dtype == _DTYPES["f32"]:
        return x.astype(jnp.float32)
    # Rounding site: RNE to the compute dtype, then (on CPU) back to the f32 carrier.
    return x.astype(dtype).astype(carrier)


def _preset(**kw) -> Policy:
    return Policy(**kw)


def _regions(names: Iterable[str]) -> frozenset[str]:
    return frozenset(names)


# Named policies (`fp32`, `bf16`, ...) that `Policy.parse` accepts as shorthands.
PRESETS: dict[str, Policy] = {
    "fp32": _preset(),
    "bf16": _preset(compute_dtype="bf16"),
    # Rounding locations of a typical bf16 inference engine: bf16 RoPE, a bf16
    # residual rounded before the RMSNorm variance, bf16 silu*u, bf16 scores.
    "bf16-engine": _preset(compute_dtype="bf16", f32_regions=_regions(())),
    "fp16": _preset(compute_dtype="f16"),
    "fp8": _preset(compute_dtype="bf16", matmul_format="fp8"),
    "mxfp8": _preset(compute_dtype="bf16", matmul_format="mxfp8"),
    "mxfp4": _preset(compute_dtype="bf16", matmul_format="mxfp4"),
    "nvfp4": _preset(compute_dtype="bf16", matmul_format="nvfp4"),
}
# The default policy of the library's functions: f32 throughout.
FP32: Policy = PRESETS["fp32"]


def __getattr__(name: str):
    if name == "native_low_precision":
        raise AttributeError("native_low_precision is gone: storage is the policy's own field; "
                             "read Policy.native (set it with s=native)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
