"""The seven sync checks between what the exporter wrote and what the sampler holds.

Each check is a host-side function returning a `CheckResult`; `run_sync_checks`
runs all seven and returns a `SyncReport`. Inputs: the exporter's served tree
(`written`) and its hashes (`layout.hash_served`), the sampler's `SamplerState`,
the layout the sampler expects (`layout.layout_of` of an `eval_shape` of the
export, see `expected_layout`), the learner's export version, and fixed probe
tokens.

1. `layout`: the served tensor set is complete; names, shapes, dtypes, formats
   and block axes are as expected.
2. `hashes`: payload and scale bytes hash equal between what the exporter wrote
   and what the sampler holds.
3. `scales`: scales are finite and positive (NVFP4 block scales may be 0), of
   the format's dtype, shaped for their block axis (which is the tensor's
   reduction axis), and powers of two for E8M0.
4. `version`: the sampler's weights version is the learner step that exported
   them, and its caches were not built on older weights.
5. `unquantized_exact`: tensors that are not quantized arrive bit-exact; those
   the exporter kept in the master's dtype equal the master bit for bit.
6. `requantize_fixed_point`: re-quantizing the dequantized weights gives the
   same codes. One re-normalization is allowed: an MX block whose largest code
   is exactly half the element max (the ceil scale rule produces it when the
   block amax rounds down onto it) re-quantizes one binade lower with codes
   exactly doubled and the same values. Per-tensor scales (FP8, ternary gamma,
   NVFP4 tensor scale) are re-derived from the values and not compared.
7. `probe_logprobs`: on fixed probe tokens the learner's served-copy forward and
   the sampler's forward give the same log-probs: bit-equal when the run uses
   matched policies, else within `atol` (default `PROBE_ATOL` = 0.05 nats,
   what a bf16-vs-f32 forward of a small model stays within).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.numerics.formats import quantize as quantize_array
from jaxrl_lp.numerics.policy import Policy, require
from jaxrl_lp.numerics.qarray import FORMATS, dequantize
from jaxrl_lp.sync.export import Exporter, served_params_for_forward, straight_through_served
from jaxrl_lp.sync.layout import TensorSpec, flatten_served, hash_served, is_qarray, layout_of
from jaxrl_lp.sync.probe import PROBE_ATOL, check_probe_logprobs, probe_logprobs
from jaxrl_lp.sync.report import CheckResult, SamplerState, SyncReport, result

__all__ = [
    "CHECK_NAMES", "check_hashes", "check_layout", "check_requantize_fixed_point", "check_scales",
    "check_unquantized_exact", "check_version", "expected_layout", "run_sync_checks",
]

# The seven sync checks, in the order `run_sync_checks` reports them.
CHECK_NAMES = ("layout", "hashes", "scales", "version", "unquantized_exact",
               "requantize_fixed_point", "probe_logprobs")


def expected_layout(exporter: Exporter, params: Any) -> dict[str, TensorSpec]:
    """The layout `exporter` writes for `params` (shapes only; nothing is computed)."""
    shapes = jax.eval_shape(lambda p: exporter.apply(p, exporter.init(p))[0], params)
    return layout_of(shapes)


def check_layout(held: Any, expected: dict[str, TensorSpec]) -> CheckResult:
    """Check 1: the sampler holds exactly the expected components with their specs."""
    got = layout_of(held)
    problems = [f"missing {k}" for k in sorted(set(expected) - set(got))]
    problems += [f"unexpected {k}" for k in sorted(set(got) - set(expected))]
    problems += [f"{k}: {got[k]} != expected {expected[k]}" for k in sorted(set(got) & set(expected))
                 if got[k] != expected[k]]
    return result("layout", problems, f"{len(got)} components as expected")


def check_hashes(written_hashes: dict[str, str], held: Any) -> CheckResult:
    """Check 2: the sampler's payload and scale bytes hash as the exporter wrote them."""
    got = hash_served(held)
    problems = [f"{k}: not held" for k in sorted(set(written_hashes) - set(got))]
    problems += [f"{k}: not written by the exporter" for k in sorted(set(got) - set(written_hashes))]
    problems += [f"{k}: bytes differ (hash {got[k][:12]} != written {written_hashes[k][:12]})"
                 for k in sorted(set(got) & set(written_hashes)) if got[k] != written_hashes[k]]
    return result("hashes", problems, f"{len(got)} components hash equal")


def _scale_problems(path: str, q: Any, axis: int | None) -> list[str]:
    spec = FORMATS.get(q.format)
    if spec is None:
        return [f"{path}: unknown format {q.format!r}"]
    shape, out = tuple(q.codes.shape), []
    if axis is not None and q.axis != axis:
        out.append(f"{path}: scales on axis {q.axis}, expected the reduction axis {axis}")
    if spec.is_block:
        if shape[q.axis] % spec.block_size:
            out.append(f"{path}: axis {q.axis} of {shape} not a multiple of {spec.block_size}")
        want = shape[:q.axis] + (shape[q.axis] // spec.block_size,) + shape[q.axis + 1:]
    else:
        want = tuple(n if i in q.batch_axes else 1 for i, n in enumerate(shape))
    dtype = {"block_e8m0": "float8_e8m0fnu", "block_e4m3_tensor_f32": "float8_e4m3fn"}.get(
        spec.scale_kind, "float32")
    s = q.scales
    if tuple(s.shape) != want:
        out.append(f"{path}: scales shape {tuple(s.shape)}, expected {want}")
    if np.dtype(s.dtype).name != dtype:
        out.append(f"{path}: scales dtype {np.dtype(s.dtype).name}, expected {dtype}")
    # Counted where the scales live (sharded arrays are not gathered): scalars come back.
    counts = _scale_counts(jnp.asarray(s).astype(jnp.float32),
                           spec.scale_kind == "block_e4m3_tensor_f32")
    non_finite, not_positive, not_pow2 = (int(c) for c in counts)
    if non_finite:
        out.append(f"{path}: {non_finite} non-finite scale(s)")
    if not_positive:
        out.append(f"{path}: {not_positive} scale(s) not positive")
    if spec.scale_kind == "block_e8m0" and not_pow2:
        out.append(f"{path}: {not_pow2} E8M0 scale(s) not a power of two")
    ts = q.tensor_scale
    if (spec.scale_kind == "block_e4m3_tensor_f32") != (ts is not None):
        out.append(f"{path}: tensor scale {'missing' if ts is None else 'unexpected'}")
    elif ts is not None:
        t = np.asarray(ts, np.float32)
        want_t = tuple(n if i in q.batch_axes else 1 for i, n in enumerate(shape))
        if tuple(t.shape) != want_t or not (np.isfinite(t) & (t > 0)).all():
            out.append(f"{path}: tensor scale of shape {t.shape} not finite and positive, "
                       f"expected shape {want_t}")
    return out


@functools.partial(jax.jit, static_argnums=1)
def _scale_counts(v: jax.Array, zero_ok: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(non-finite, not positive, finite positive but not a power of two) scale counts."""
    finite = jnp.isfinite(v)
    positive = (v >= 0) if zero_ok else (v > 0)
    mant = jnp.frexp(jnp.where(finite & (v > 0), v, 1.0))[0]
    return (jnp.sum(~finite), jnp.sum(finite & ~positive),
            jnp.sum(finite & (v > 0) & (mant != 0.5)))


@jax.jit
def _non_finite(v: jax.Array) -> jax.Array:
    return jnp.sum(~jnp.isfinite(v.astype(jnp.float32)))


def check_scales(held: Any, expected: dict[str, TensorSpec] | None = None) -> CheckResult:
    """Check 3: scales finite, positive, well-shaped on their block axis, E8M0 powers of two;
    every unquantized served tensor finite.

    A non-finite master quantizes to non-finite scales (`numerics.formats`: the NaN
    reaches every value of its block or tensor), so a diverged run fails here
    whatever its served format.
    """
    problems, n = [], 0
    for path, leaf in flatten_served(held).items():
        if is_qarray(leaf):
            n += 1
            spec = (expected or {}).get(f"{path}.codes")
            problems += _scale_problems(path, leaf, None if spec is None else spec.axis)
        elif jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating):
            if bad := int(_non_finite(jnp.asarray(leaf))):
                problems.append(f"{path}: {bad} non-finite value(s)")
    return result("scales", problems, f"scales of {n} quantized tensors are valid and every "
                                      "unquantized tensor is finite")


def check_version(learner_version: int, sampler: SamplerState) -> CheckResult:
    """Check 4: the sampler serves the learner's export and dropped caches of older weights."""
    problems = []
    if int(sampler.version) != int(learner_version):
        problems.append(f"sampler holds weights version {int(sampler.version)}, the learner "
                        f"exported version {int(learner_version)}")
    if sampler.cache_version is not None and int(sampler.cache_version) != int(sampler.version):
        problems.append(f"sampler caches were built on weights version {int(sampler.cache_version)}"
                        f" and not dropped after loading version {int(sampler.version)}")
    return result("version", problems, f"version {int(learner_version)}, caches current")


def _bits(x: jax.Array) -> jax.Array:
    """The bit pattern of every element, as unsigned integers of the same width."""
    width = np.dtype(x.dtype).itemsize
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32,
                                                8: jnp.uint64}[width])
    return x


def _same_bits(a: Any, b: Any) -> bool:
    """Same dtype, shape and bits, compared where the arrays live (no gather)."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(jnp.all(_bits(a) == _bits(b)))


def check_unquantized_exact(written: Any, held: Any, master: Any = None) -> CheckResult:
    """Check 5: non-quantized tensors arrive bit-exact (and kept ones equal the master)."""
    w, h = flatten_served(written), flatten_served(held)
    m = {} if master is None else flatten_served(master)
    problems, n = [], 0
    for path, x in w.items():
        if is_qarray(x):
            continue
        n += 1
        if path not in h or is_qarray(h[path]):
            problems.append(f"{path}: not held as an array")
        elif not _same_bits(x, h[path]):
            problems.append(f"{path}: held bits differ from the written ones")
        if path in m and jnp.asarray(x).dtype == jnp.asarray(m[path]).dtype \
                and not _same_bits(x, m[path]):
            problems.append(f"{path}: kept in {jnp.asarray(x).dtype} but differs from the master")
    return result("unquantized_exact", problems, f"{n} unquantized tensors bit-exact")


def _blocks(x: jax.Array, axis: int, bs: int) -> jax.Array:
    return x.reshape(x.shape[:axis] + (x.shape[axis] // bs, bs) + x.shape[axis + 1:])


@jax.jit
def _requantize(qs: dict) -> dict:
    """`quantize(dequantize(q))` of every `QArray` of a flat dict (one compile per layout)."""
    return {k: quantize_array(dequantize(q), q.format, q.axis, q.batch_axes)
            for k, q in qs.items()}


def _requantize_mismatch(q: Any, req: Any) -> tuple[int, int]:
    """(elements whose re-quantized code differs, elements), after the allowed MX renorm."""
    spec = FORMATS[q.format]
    renorm = spec.scale_kind == "block_e8m0"
    bad = _mismatch_count(q.codes, req.codes, q.scales, req.scales, q.axis,
                          spec.block_size if renorm else 0, float(spec.max_value))
    return int(bad), int(np.prod(q.codes.shape))


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _mismatch_count(codes, req_codes, scales, req_scales, axis: int, block: int,
                    max_value: float) -> jax.Array:
    """Codes that change when re-quantized, counted where they live (MX: renorm allowed)."""
    # Upcast: every code is exact in f32.
    c, rc = codes.astype(jnp.float32), req_codes.astype(jnp.float32)
    bad = ~(c == rc)  # NaN codes count as mismatches
    if block:
        cb, rcb, badb = (_blocks(x, axis, block) for x in (c, rc, bad))
        s, rs = scales.astype(jnp.float32), req_scales.astype(jnp.float32)
        renorm = ((jnp.max(jnp.abs(cb), axis=axis + 1) == max_value / 2) & (rs == s / 2)
                  & jnp.all(rcb == 2 * cb, axis=axis + 1))
        bad = (badb & ~jnp.expand_dims(renorm, axis + 1)).reshape(c.shape)
    return jnp.sum(bad)


def check_requantize_fixed_point(held: Any) -> CheckResult:
    """Check 6: re-quantizing the dequantized weights reproduces their codes."""
    qs = {p: x for p, x in flatten_served(held).items() if is_qarray(x) and x.format in FORMATS}
    try:
        reqs = _requantize(qs)
    except Exception as e:  # malformed QArrays cannot be re-quantized: a failed check
        return CheckResult("requantize_fixed_point", False, f"cannot re-quantize: {e}"[:300])
    problems, n = [], 0
    for path, leaf in qs.items():
        n += 1
        bad, size = _requantize_mismatch(leaf, reqs[path])
        if bad:
            problems.append(f"{path}: {bad} of {size} codes change when re-quantized "
                            f"({leaf.format})")
    return result("requantize_fixed_point", problems, f"{n} quantized tensors are fixed points")


def _probe_check(written, sampler, master, cfg, tokens, learner_policy, matched, atol, logprobs):
    if logprobs is not None:
        return check_probe_logprobs(*logprobs, matched=matched, atol=atol,
                                    learner_policy=learner_policy, sampler_policy=sampler.policy)
    if cfg is None or tokens is None or learner_policy is None:
        raise ValueError("run_sync_checks: check 7 needs cfg, probe_tokens and learner_policy, "
                         "or logprobs=(learner_lp, sampler_lp)")
    learner = served_params_for_forward(written)
    if master is not None:
        learner = straight_through_served(master, learner)
    sampler_policy = sampler.policy or learner_policy
    try:
        lp_l = probe_logprobs(learner, cfg, learner_policy, tokens)
        lp_s = probe_logprobs(served_params_for_forward(sampler.params), cfg, sampler_policy,
                              tokens)
    except Exception as e:  # a broken served tree cannot run: that is a failed check
        return CheckResult("probe_logprobs", False, f"probe forward failed: {e}"[:300])
    return check_probe_logprobs(lp_l, lp_s, matched=matched, atol=atol,
                                learner_policy=learner_policy, sampler_policy=sampler_policy)


def run_sync_checks(written: Any, written_hashes: dict[str, str], sampler: SamplerState,
                    expected: dict[str, TensorSpec], learner_version: int, *,
                    master: Any = None, cfg: Any = None, probe_tokens: Any = None,
                    learner_policy: Policy | None = None, matched: bool = True,
                    atol: float = PROBE_ATOL, logprobs: tuple[Any, Any] | None = None
                    ) -> SyncReport:
    """Runs the seven checks (module docstring) and returns a `SyncReport`.

    Args:
      written: the served tree the exporter wrote.
      written_hashes: `hash_served(written)`, computed where it was written.
      sampler: what the sampler holds.
      expected: the layout the sampler expects (`expected_layout`).
      learner_version: the learner step that exported `written`.
      master: the learner's f32 master params (check 5's kept tensors; the
        learner's probe forward uses `straight_through_served(master, written)`).
      cfg: the model of check 7's probe.
      probe_tokens: the probe of check 7 (int tokens [B, T]).
      learner_policy: the learner's policy for check 7's probe; the sampler's
        forward uses `sampler.policy` (default: the learner's).
      matched: whether the run pairs matched policies (bit-equality) or not (`atol`).
      logprobs: precomputed `(learner_lp, sampler_lp)` for check 7 instead.

    Examples:
      >>> report = run_sync_checks(served, hash_served(served), SamplerState(held, 7),
      ...                          expected_layout(exporter, params), 7, cfg=cfg,
      ...                          probe_tokens=tokens, learner_policy=Policy(compute_dtype="bf16"))
      >>> assert report.passed, str(report)
    """
    lp = None if learner_policy is None else require(learner_policy, "run_sync_checks")
    return SyncReport((
        check_layout(sampler.params, expected),
        check_hashes(written_hashes, sampler.params),
        check_scales(sampler.params, expected),
        check_version(learner_version, sampler),
        check_unquantized_exact(written, sampler.params, master),
        check_requantize_fixed_point(sampler.params),
        _probe_check(written, sampler, master, cfg, probe_tokens, lp, matched, atol, logprobs),
    ))
