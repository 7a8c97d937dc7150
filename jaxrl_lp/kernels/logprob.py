"""Fused vocab-tiled log-prob and entropy of chosen tokens, from the hidden state.

For rows t of `h [T, D]`, the output matrix `W [D, V]` (the lm head, or the
tied embedding transposed), chosen tokens `c_t` and temperature `tau`:

    z = round_logits(h @ W)        (f32 accumulation, rounded to the policy's logits dtype)
    s = z / tau,  lse_t = log sum_v exp(s_tv),  p = exp(s - lse)
    logp_t = s_{t,c_t} - lse_t,    H_t = lse_t - sum_v p_tv s_tv

One pass over vocabulary tiles of `block_v` columns (an online logsumexp)
gives both outputs: per row a running max `m`, `l = sum exp(s - m)`,
`a = sum exp(s - m) (s - m)` and the chosen token's `s` (picked from its
tile). On a new max `m'` the sums are rescaled, `l <- l e^(m-m') + ...`,
`a <- e^(m-m') (a + (m - m') l) + ...`; at the end `lse = m + log l` and
`H = log l - a / l`. The backward (`jax.custom_vjp`) recomputes each tile:

    dL/dz_tv = [g_logp (1[v = c_t] - p_tv) - g_H p_tv (s_tv - E_p s_t)] / tau

rounded to the logits dtype (what autodiff of the plain path's rounding
does), then `dh = sum_tiles dz W_tile^T` and `dW_tile = h^T dz`. The entropy
gradient is exact, not stopped. No `[T, V]` array exists: the largest
temporaries are `[T, block_v]` (reference) or `[block_t, block_v]` (kernel).

Implementations, by `kernels.dispatch.choose(policy, "logprob")`: the Pallas
kernel (`kernels.logprob_pallas`), the same kernel interpreted, or the jnp
reference here (a `lax.scan` over vocabulary tiles). Tolerances, checked by
tests/test_kernels_logprob.py in f32: every implementation's log-probs and
entropies within 1e-5 absolute + 1e-6 relative of `jax.nn.log_softmax` over
materialized logits, gradients within 1e-5 absolute + 1e-4 relative of
autodiff through it. Policies with a `matmul_format` are refused: the lm
head's quantized matmul (and its straight-through backward) stays on the
plain path (`fused_readout` is False for them).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.kernels.dispatch import choose
from jaxrl_lp.numerics.policy import Policy

__all__ = ["BLOCK_T", "BLOCK_V", "LogprobPlan", "check_blocks", "fused_logprobs", "fused_readout",
           "reference_backward", "reference_forward"]

BLOCK_T = 16  # rows per kernel program (Triton dots need >= 16)
BLOCK_V = 512  # vocabulary columns per tile
LANES = 128  # the lane width a compiled tile's vocabulary axis is a multiple of
_NEG = -1e30  # the running max before any tile: finite, so (m - m') * 0 is 0, not NaN


class LogprobPlan(NamedTuple):
    """The static description of one fused call (hashable: a `custom_vjp` static)."""

    temperature: float
    logits_dtype: np.dtype  # z is rounded to it (and dz, as autodiff of the rounding does)
    block_t: int  # rows per kernel program
    block_v: int  # vocabulary columns per tile
    block_d: int  # hidden columns per matmul chunk (divides D)
    impl: str  # `kernels.dispatch.Choice`


def fused_readout(policy: Policy | str) -> bool:
    """Whether log-probs are read out through `fused_logprobs` from the hidden state.

    True where the policy selects the kernel (`choose` is `kernel` or
    `interpret`) and has no `matmul_format`; False keeps the plain path
    (logits, then `log_softmax`), bit for bit what it was. Raises
    `KernelUnavailableError` for `kernels=on` where no kernel runs.
    """
    policy = Policy.parse(policy)
    return choose(policy, "logprob") != "reference" and policy.matmul_format is None


def check_blocks(d: int, v: int, block_t: int, block_v: int, block_d: int, *,
                 compiled: bool) -> None:
    """Raises one ValueError naming the first tile size that does not fit.

    Every size must be a positive int and `block_d` must divide the matmul's
    reduction axis `D`. A compiled kernel (GPU) also needs power-of-two tiles,
    `block_v` a multiple of the 128-wide lane, and a last vocabulary tile
    (`V % block_v`) that is 0 or a power of two >= 16 (Triton's block shapes).
    """
    for name, b in (("block_t", block_t), ("block_v", block_v), ("block_d", block_d)):
        if not isinstance(b, int | np.integer) or isinstance(b, bool) or b < 1:
            raise ValueError(f"fused_logprobs: {name} must be a positive int; got {b!r}")
    if d % block_d:
        raise ValueError(f"fused_logprobs: block_d={block_d} does not divide the reduction axis "
                         f"D={d}; pass a divisor of D")
    if not compiled:
        return
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0
    bad = [f"{n}={b} is not a power of two >= 16" for n, b in
           (("block_t", block_t), ("block_v", block_v), ("block_d", block_d)) if not pow2(b)]
    if block_v % LANES:
        bad.append(f"block_v={block_v} is not a multiple of the {LANES}-wide lane")
    if v % block_v and not pow2(v % block_v):
        bad.append(f"the last vocabulary tile (V={v} % block_v={block_v} = {v % block_v}) is "
                   "not a power of two >= 16")
    if bad:
        raise ValueError(f"fused_logprobs: tile does not fit the compiled kernel: {bad[0]}")


# ----------------------------------------------------------------- tile maths (reference and kernel)
class Running(NamedTuple):
    """Online statistics of the tempered logits over the vocabulary tiles seen so far."""

    m: jax.Array  # [T] running max of s
    l: jax.Array  # [T] sum exp(s - m)
    a: jax.Array  # [T] sum exp(s - m) (s - m)
    c: jax.Array  # [T] s of the chosen token (0 until its tile is seen)


def running_init(t: int) -> Running:
    z = jnp.zeros((t,), jnp.float32)
    return Running(jnp.full((t,), _NEG, jnp.float32), z, z, z)


def tempered(acc_TxW: jax.Array, plan: LogprobPlan) -> jax.Array:
    """s = round_logits(acc) / tau, f32."""
    z = acc_TxW.astype(plan.logits_dtype).astype(jnp.float32)
    return z / plan.temperature


def running_update(run: Running, s_TxW: jax.Array, v0, tokens_T: jax.Array) -> Running:
    """`run` after the tile `s_TxW` of columns `[v0, v0 + W)`."""
    cols = v0 + jax.lax.broadcasted_iota(jnp.int32, s_TxW.shape, 1)
    m = jnp.maximum(run.m, jnp.max(s_TxW, axis=1))
    scale = jnp.exp(run.m - m)
    d = s_TxW - m[:, None]
    e = jnp.exp(d)
    return Running(m, run.l * scale + jnp.sum(e, axis=1),
                   scale * (run.a + (run.m - m) * run.l) + jnp.sum(e * d, axis=1),
                   run.c + jnp.sum(jnp.where(cols == tokens_T[:, None], s_TxW, 0.0), axis=1))


def running_finish(run: Running, mask_T: jax.Array):
    """(logp, entropy, lse, E_p s) per row; masked rows give log-prob and entropy 0."""
    log_l = jnp.log(run.l)
    mean_rel = run.a / run.l  # E_p[s] - m
    lp = jnp.where(mask_T, run.c - (run.m + log_l), 0.0)
    ent = jnp.where(mask_T, log_l - mean_rel, 0.0)
    return lp, ent, run.m + log_l, run.m + mean_rel


def tile_dlogits(s_TxW, v0, tokens_T, lse_T, mean_T, g_lp_T, g_ent_T, plan: LogprobPlan):
    """The cotangent of one tile's f32 accumulator [T, W] (module docstring)."""
    cols = v0 + jax.lax.broadcasted_iota(jnp.int32, s_TxW.shape, 1)
    p = jnp.exp(s_TxW - lse_T[:, None])
    onehot = jnp.where(cols == tokens_T[:, None], 1.0, 0.0)
    ds = g_lp_T[:, None] * (onehot - p) - g_ent_T[:, None] * p * (s_TxW - mean_T[:, None])
    return (ds / plan.temperature).astype(plan.logits_dtype).astype(jnp.float32)


def _compiled_tiles(d: int, v: int, block_t: int, block_v: int, block_d: int | None):
    """(impl, block_v, block_d) for `kernels=auto` on a device: the compiled kernel
    with the first tiles that fit (`block_v` halved down to 128, the largest
    power-of-two `block_d` <= 512 dividing D), else the reference scan.

    Qwen3's V = 151936 leaves a last tile of 384 at `block_v=512`, so it runs
    at 256. The choice depends on D and V only, so the sampler and the learner
    (same model, same policy) make the same one.
    """
    pow2_d = [b for b in (512, 256, 128, 64, 32, 16) if d % b == 0]
    for bv in dict.fromkeys((block_v, 256, 128)):
        for bd in ([block_d] if block_d is not None else pow2_d[:1]):
            try:
                check_blocks(d, v, block_t, bv, bd, compiled=True)
            except ValueError:
                continue
            return "kernel", bv, bd
    return "reference", block_v, block_d


# ----------------------------------------------------------------- the jnp reference
def _mm(a, b, spec):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST)


def _over_tiles(tile, carry, v: int, bv: int):
    """`tile(carry, v0, width)` over the full tiles (a `lax.scan`) and the ragged last one."""
    nfull, r = divmod(v, bv)
    if nfull:
        carry, _ = jax.lax.scan(lambda c, j: (tile(c, j * bv, bv), None), carry,
                                jnp.arange(nfull, dtype=jnp.int32))
    return tile(carry, nfull * bv, r) if r else carry


def reference_forward(h_TxD, w_DxV, tokens_T, mask_T, plan: LogprobPlan):
    """(logp, entropy, lse, E_p s), each [T] f32, by a scan over vocabulary tiles."""

    def tile(run, v0, width):
        s = tempered(_mm(h_TxD, jax.lax.dynamic_slice_in_dim(w_DxV, v0, width, 1), "td,dv->tv"),
                     plan)
        return running_update(run, s, v0, tokens_T)

    run = _over_tiles(tile, running_init(h_TxD.shape[0]), w_DxV.shape[1], plan.block_v)
    return running_finish(run, mask_T)


def reference_backward(h_TxD, w_DxV, tokens_T, lse_T, mean_T, g_lp_T, g_ent_T,
                       plan: LogprobPlan):
    """(dh [T, D], dW [D, V]) in the dtypes of h and W; the g's are already masked."""

    def tile(carry, v0, width):
        dh, dw = carry
        w_tile = jax.lax.dynamic_slice_in_dim(w_DxV, v0, width, 1)
        s = tempered(_mm(h_TxD, w_tile, "td,dv->tv"), plan)
        dz = tile_dlogits(s, v0, tokens_T, lse_T, mean_T, g_lp_T, g_ent_T, plan)
        dw = jax.lax.dynamic_update_slice_in_dim(dw, _mm(h_TxD, dz, "td,tv->dv"), v0, 1)
        return dh + _mm(dz, w_tile, "tv,dv->td"), dw

    zeros = (jnp.zeros(h_TxD.shape, jnp.float32), jnp.zeros(w_DxV.shape, jnp.float32))
    dh, dw = _over_tiles(tile, zeros, w_DxV.shape[1], plan.block_v)
    return dh.astype(h_TxD.dtype), dw.astype(w_DxV.dtype)


# ----------------------------------------------------------------- custom_vjp and the entry point
def _forward(h, w, tokens, mask, plan: LogprobPlan):
    if plan.impl == "reference":
        return reference_forward(h, w, tokens, mask, plan)
    from jaxrl_lp.kernels import logprob_pallas  # the kernel module imports the tile maths above

    return logprob_pallas.kernel_forward(h, w, tokens, mask, plan)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(h, w, tokens, mask, plan: LogprobPlan):
    return _forward(h, w, tokens, mask, plan)[:2]


def _fused_fwd(h, w, tokens, mask, plan):
    lp, ent, lse, mean = _forward(h, w, tokens, mask, plan)
    return (lp, ent), (h, w, tokens, mask, lse, mean)


def _fused_bwd(plan, res, g):
    h, w, tokens, mask, lse, mean = res
    g_lp, g_ent = (jnp.where(mask, x, 0.0) for x in g)
    if plan.impl == "reference":
        dh, dw = reference_backward(h, w, tokens, lse, mean, g_lp, g_ent, plan)
    else:
        from jaxrl_lp.kernels import logprob_pallas

        dh, dw = logprob_pallas.kernel_backward(h, w, tokens, lse, mean, g_lp, g_ent, plan)
    return dh, dw, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_logprobs(h_TxD: jax.Array, w_DxV: jax.Array, tokens_T: jax.Array, temperature: float,
                   policy: Policy | str, *, mask_T: jax.Array | None = None,
                   block_v: int | None = None, block_t: int = BLOCK_T, block_d: int | None = None):
    """Log-prob of the chosen tokens and entropy of `softmax(round_logits(h @ W) / tau)`, f32.

    Differentiable in `h` and `W` (both outputs; own backward, module
    docstring). Not jitted itself; traced inside the sampler's and the
    learner's programs. The implementation is `choose(policy, "logprob")`'s.

    Args:
      h_TxD: final normed hidden states (rows flattened), compute precision.
      w_DxV: the output matrix (rounded here by `policy.round_params`, as `dot` does).
      tokens_T: int chosen tokens in `[0, V)`.
      temperature: Python float > 0 (static).
      policy: rounds the weight and the logits; its `kernels` field picks the implementation.
      mask_T: rows to compute (nonzero); the others give 0 and get no gradient. Default all.
      block_v: vocabulary columns per tile (the last tile may be ragged).
        Default `BLOCK_V`, or for a compiled kernel the first of `BLOCK_V`,
        256, 128 that fits (`_compiled_tiles`).
      block_t: rows per kernel program (rows are padded to a multiple of it).
      block_d: hidden columns per matmul chunk in the kernel; must divide D.
        Default: D, or the largest of 512, 256, ... that divides it.
        Compiled under `kernels=auto`, tiles that do not fit the kernel
        (`check_blocks`) are replaced by ones that do, or the reference scan
        runs (`_compiled_tiles`); under `kernels=on` tiles passed explicitly
        that do not fit are an error.

    Returns:
      (logp [T] f32, entropy [T] f32).

    Raises:
      KernelUnavailableError: `kernels=on` where Pallas cannot compile.
      ValueError: a tile that does not fit (`check_blocks`), a policy with a
        `matmul_format`, mismatched shapes or a temperature <= 0.

    Example:
      >>> lp, ent = fused_logprobs(h, params["lm_head"], tokens, 1.0, "fp32", block_v=256)
    """
    policy = Policy.parse(policy)
    impl = choose(policy, "logprob")
    if policy.matmul_format is not None:
        raise ValueError(f"fused_logprobs: policy {policy} quantizes matmuls "
                         f"({policy.matmul_format}); the fused read-out does not: use the plain path")
    if h_TxD.ndim != 2 or w_DxV.ndim != 2 or h_TxD.shape[1] != w_DxV.shape[0] \
            or tokens_T.shape != h_TxD.shape[:1]:
        raise ValueError(f"fused_logprobs: need h [T, D], W [D, V], tokens [T]; got "
                         f"{h_TxD.shape}, {w_DxV.shape}, {tokens_T.shape}")
    if not float(temperature) > 0:
        raise ValueError(f"fused_logprobs: temperature must be > 0; got {temperature}")
    d, v = w_DxV.shape
    if impl == "kernel" and (policy.kernels == "auto" or block_v is None):
        picked, bv, bd = _compiled_tiles(d, v, block_t, BLOCK_V if block_v is None else block_v,
                                         block_d)
        if picked == "kernel" or policy.kernels == "auto":  # under `on`, a misfit raises below
            impl, block_v, block_d = picked, bv, bd
    block_v = BLOCK_V if block_v is None else block_v
    if block_d is None:
        block_d = d if d <= 512 else next((b for b in (512, 256, 128, 64, 32, 16) if d % b == 0), d)
    check_blocks(d, v, block_t, block_v, block_d, compiled=impl == "kernel")
    plan = LogprobPlan(float(temperature), np.dtype(policy.logits_dtype), int(block_t),
                       int(block_v), int(block_d), impl)
    mask = jnp.ones(tokens_T.shape, bool) if mask_T is None else jnp.asarray(mask_T) > 0
    return _fused(h_TxD, policy.round_params(w_DxV), tokens_T.astype(jnp.int32), mask, plan)
