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

Implementations, chosen for the platform a program is lowered for
(`kernels.dispatch.by_platform`, name `logprob`): the Pallas Triton kernels on
`cuda` (`kernels.logprob_gpu`), the Mosaic TPU kernels on `tpu`
(`kernels.logprob_tpu`: the vocabulary a sequential grid axis, one W tile in
VMEM at a time), or the jnp reference here (a `lax.scan` over vocabulary
tiles) on `cpu`; `interpret` / `interpret-tpu` run the GPU / TPU kernels in
Pallas interpret mode anywhere. Each platform's tile plan is checked against
its target's shared memory or VMEM (`kernels.targets`). Tolerances, checked
by tests/test_kernels_logprob.py and tests/test_kernel_logprob_tpu.py in f32:
every implementation's log-probs and entropies within 1e-5 absolute + 1e-6
relative of `jax.nn.log_softmax` over materialized logits, gradients within
1e-5 absolute + 1e-4 relative of autodiff through it. Policies with a
`matmul_format` are refused: the lm head's quantized matmul (and its
straight-through backward) stays on the plain path (`fused_readout` is False
for them).

Two entry points: `fused_logprobs` (this algorithm everywhere: the reference
scan where no kernel runs) and `readout_logprobs` (what the models' read-out
calls: the kernel where one runs, else the caller's plain path, logits then
`log_softmax`, so a CPU program computes exactly what it did before kernels
existed; on a GPU or TPU where no kernel runs, `tiled_readout`, the reference
scan over tiles of up to `READOUT_TILE_BYTES` of f32, so no `[T, V]` logits
exist there either).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.kernels import logprob_gpu, logprob_mgpu, logprob_tpu
from jaxrl_lp.kernels.dispatch import Version, by_platform, per_shard, refuse, shard_count
from jaxrl_lp.kernels.logprob_tiles import (  # the tile maths, shared with the kernels
    LogprobPlan,
    running_finish,
    running_init,
    running_update,
    tempered,
    tile_dlogits,
)
from jaxrl_lp.numerics.policy import Policy, require
from jaxrl_lp.numerics.products import precision_for

__all__ = ["BLOCK_V", "READOUT_FORWARDS", "READOUT_TILE_BYTES", "LogprobPlan", "fused_logprobs",
           "fused_readout", "readout_block_v", "readout_logprobs", "reference_backward",
           "reference_forward", "tiled_readout"]

BLOCK_V = 512  # vocabulary columns per tile of the reference scan
# The largest [T, block_v] f32 tile of the read-out's scan off the CPU (`tiled_readout`).
READOUT_TILE_BYTES = 1 << 29


def fused_readout(policy: Policy) -> bool:
    """Whether a model's log-probs are read out from the hidden state by `readout_logprobs`.

    True unless the policy turns the kernels off or quantizes matmuls (the lm
    head's quantized matmul and its straight-through backward stay on the
    plain path): then the steps return logits, bit for bit what they did.
    Which implementation a fused read-out runs is decided per platform when
    the program is lowered (`readout_logprobs`).
    """
    policy = require(policy, "fused_readout")
    return policy.kernels != "off" and policy.matmul_format is None


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


def reference_forward(h_TxD, w_DxV, tokens_T, mask_T, plan: LogprobPlan, mm=None):
    """(logp, entropy, lse, E_p s), each [T] f32, by a scan over vocabulary tiles; `mm(a, b,
    spec)` the products (default f32 at `HIGHEST`)."""
    mm = mm or _mm

    def tile(run, v0, width):
        s = tempered(mm(h_TxD, jax.lax.dynamic_slice_in_dim(w_DxV, v0, width, 1), "td,dv->tv"),
                     plan)
        return running_update(run, s, v0, tokens_T)

    run = _over_tiles(tile, running_init(h_TxD.shape[0]), w_DxV.shape[1], plan.block_v)
    return running_finish(run, mask_T)


def reference_backward(h_TxD, w_DxV, tokens_T, lse_T, mean_T, g_lp_T, g_ent_T,
                       plan: LogprobPlan, mm=None, round_dz=None):
    """(dh [T, D], dW [D, V]) in the dtypes of h and W; the g's are already masked. `mm` as
    `reference_forward`'s; `round_dz` rounds each tile's cotangent before its products
    (default: none). dW is written per tile in W's dtype, dh summed over the tiles in f32."""
    mm = mm or _mm

    def tile(carry, v0, width):
        dh, dw = carry
        w_tile = jax.lax.dynamic_slice_in_dim(w_DxV, v0, width, 1)
        s = tempered(mm(h_TxD, w_tile, "td,dv->tv"), plan)
        dz = tile_dlogits(s, v0, tokens_T, lse_T, mean_T, g_lp_T, g_ent_T, plan)
        dz = dz if round_dz is None else round_dz(dz)
        dw = jax.lax.dynamic_update_slice_in_dim(
            dw, mm(h_TxD, dz, "td,tv->dv").astype(dw.dtype), v0, 1)
        return dh + mm(dz, w_tile, "tv,dv->td"), dw

    zeros = (jnp.zeros(h_TxD.shape, jnp.float32), jnp.zeros(w_DxV.shape, w_DxV.dtype))
    dh, dw = _over_tiles(tile, zeros, w_DxV.shape[1], plan.block_v)
    return dh.astype(h_TxD.dtype), dw


# ----------------------------------------------------------------- custom_vjp and the entry points
def _forward(h, w, tokens, mask, plan: LogprobPlan):
    if plan.impl == "cuda":
        return logprob_gpu.kernel_forward(h, w, tokens, mask, plan)
    if plan.impl == "tpu":
        return logprob_tpu.tpu_forward(h, w, tokens, mask, plan, plan.tpu, plan.interpret)
    return reference_forward(h, w, tokens, mask, plan)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(h, w, tokens, mask, plan: LogprobPlan):
    return _forward(h, w, tokens, mask, plan)[:2]


def _fused_fwd(h, w, tokens, mask, plan):
    lp, ent, lse, mean = _forward(h, w, tokens, mask, plan)
    return (lp, ent), (h, w, tokens, mask, lse, mean)


def _fused_bwd(plan, res, g):
    h, w, tokens, mask, lse, mean = res
    g_lp, g_ent = (jnp.where(mask, x, 0.0) for x in g)
    if plan.impl == "cuda":
        dh, dw = logprob_gpu.kernel_backward(h, w, tokens, lse, mean, g_lp, g_ent, plan)
    elif plan.impl == "tpu":
        dh, dw = logprob_tpu.tpu_backward(h, w, tokens, lse, mean, g_lp, g_ent, plan, plan.tpu,
                                          plan.interpret)
    else:
        dh, dw = reference_backward(h, w, tokens, lse, mean, g_lp, g_ent, plan)
    return dh, dw, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def _check(h_TxD, w_DxV, tokens_T, temperature, policy: Policy, block_v, block_t, block_d):
    if policy.matmul_format is not None:
        raise ValueError(f"fused_logprobs: policy {policy} quantizes matmuls "
                         f"({policy.matmul_format}); the fused read-out does not: use the plain path")
    if h_TxD.ndim != 2 or w_DxV.ndim != 2 or h_TxD.shape[1] != w_DxV.shape[0] \
            or tokens_T.shape != h_TxD.shape[:1]:
        raise ValueError(f"fused_logprobs: need h [T, D], W [D, V], tokens [T]; got "
                         f"{h_TxD.shape}, {w_DxV.shape}, {tokens_T.shape}")
    if not float(temperature) > 0:
        raise ValueError(f"fused_logprobs: temperature must be > 0; got {temperature}")
    for name, b in (("block_t", block_t), ("block_v", block_v), ("block_d", block_d)):
        if b is not None and (not isinstance(b, int | np.integer) or isinstance(b, bool) or b < 1):
            raise ValueError(f"fused_logprobs: {name} must be a positive int; got {b!r}")
    if block_d is not None and w_DxV.shape[0] % block_d:
        raise ValueError(f"fused_logprobs: block_d={block_d} does not divide the reduction axis "
                         f"D={w_DxV.shape[0]}; pass a divisor of D")


def _by_platform(h, w, tokens, mask, temperature, policy: Policy, reference, tiles: dict):
    """`reference()` or `_fused` by the kernel of the platform lowered for (`by_platform`)."""
    from jaxrl_lp.kernels.targets import current_target

    (t, d), v = h.shape, w.shape[1]
    shards = shard_count("batch")
    t = t // shards if t % shards == 0 else t  # the rows of one device's shard (`per_shard`)
    explicit = {k: tiles.get(k) for k in ("block_t", "block_v", "block_d")}
    compiled, gpu_misfit = logprob_gpu.plan_tiles(t, d, v, h.dtype, w.dtype, **explicit)
    if policy.kernels == "auto" and gpu_misfit is not None and any(explicit.values()):
        compiled, gpu_misfit = logprob_gpu.plan_tiles(t, d, v, h.dtype, w.dtype)
    # Interpreted, any tile runs: the caller's, else the compiled plan's (a hidden chunk that
    # divides D: a D no power of two divides takes one chunk).
    shown = logprob_gpu.GpuTiles(*(explicit[k] or getattr(compiled, k)
                                   for k in logprob_gpu.GpuTiles._fields))
    if d % shown.block_d:
        shown = shown._replace(block_d=d)
    # TPU: the caller's plan, else the largest that fits the current tpu target's VMEM; where
    # none fits, the plan interpreted runs (any tile interprets) and compiled is the misfit.
    tpu_tiles = tiles.get("tpu_tiles")
    if tpu_tiles is None:
        planned = logprob_tpu.tpu_tiles(t, d, v, h.dtype, w.dtype,
                                        current_target("tpu").limit_bytes)
        tpu_tiles = (logprob_tpu.tpu_tiles(t, d, v, h.dtype, w.dtype, 1 << 62)
                     if isinstance(planned, str) else planned)
        tpu_misfit = planned if isinstance(planned, str) else None
    else:
        tpu_misfit = logprob_tpu.plan_misfit(tpu_tiles, d, h.dtype, w.dtype)
    base = LogprobPlan(float(temperature), np.dtype(policy.logits_dtype), *shown, "reference")

    def run(impl, gpu, interpret, tpu=None):
        plan = base._replace(impl=impl, interpret=interpret, tpu=tpu, **gpu._asdict())
        # Under a mesh, each device's rows (W whole on every device; its gradient summed).
        rows = ("batch",)
        kernel = per_shard(lambda *a: _fused(*a, plan), (rows + (None,), None, rows, rows),
                           (rows, rows))
        return kernel(h, w, tokens, mask)

    cuda = Version(lambda i: run("cuda", shown if i else compiled, i), gpu_misfit)
    tpu = Version(lambda i: run("tpu", shown, i, tpu_tiles), tpu_misfit)
    return by_platform("logprob", policy, reference, cuda=cuda, tpu=tpu)


def fused_logprobs(h_TxD: jax.Array, w_DxV: jax.Array, tokens_T: jax.Array, temperature: float,
                   policy: Policy, *, mask_T: jax.Array | None = None,
                   block_v: int | None = None, block_t: int | None = None,
                   block_d: int | None = None, tpu_tiles=None):
    """Log-prob of the chosen tokens and entropy of `softmax(round_logits(h @ W) / tau)`, f32.

    Differentiable in `h` and `W` (both outputs; own backward, module
    docstring). Not jitted itself; traced inside the sampler's and the
    learner's programs. The implementation is the platform's
    (`kernels.dispatch.by_platform`, name `logprob`); where no kernel runs,
    the reference scan.

    Args:
      h_TxD: final normed hidden states (rows flattened), compute precision.
      w_DxV: the output matrix (rounded here by `policy.round_params`, as `dot` does).
      tokens_T: int chosen tokens in `[0, V)`.
      temperature: Python float > 0 (static).
      policy: rounds the weight and the logits; its `kernels` field picks the implementation.
      mask_T: rows to compute (nonzero); the others give 0 and get no gradient. Default all.
      block_v: vocabulary columns per tile (the reference scan's, default
        `BLOCK_V`; and the GPU kernel's).
      block_t, block_d: the GPU kernel's rows per program and hidden columns
        per matmul chunk (`block_d` must divide D). The compiled GPU tile is
        `logprob_gpu.plan_tiles`' (these sizes kept where given): under
        `kernels=auto` a tile that does not fit (its shape rules or its
        shared memory on the current cuda target) is replaced by the default
        plan, or the reference runs; under `kernels=on` it is an error when
        the program is lowered for cuda.
      tpu_tiles: the TPU kernels' `logprob_tpu.TpuLogprobTiles` (default
        `logprob_tpu.tpu_tiles`' plan for the current tpu target's VMEM).

    Returns:
      (logp [T] f32, entropy [T] f32).

    Raises:
      KernelUnavailableError: `kernels=on` lowered for a platform without the
        kernel (cpu) or whose tile does not fit.
      ValueError: a bad tile size, a policy with a `matmul_format`,
        mismatched shapes or a temperature <= 0.

    Examples:
      >>> lp, ent = fused_logprobs(h, params["lm_head"], tokens, 1.0, FP32, block_v=256)
    """
    policy = require(policy, "fused_logprobs")
    _check(h_TxD, w_DxV, tokens_T, temperature, policy, block_v, block_t, block_d)
    w = policy.round_params(w_DxV)
    tokens = tokens_T.astype(jnp.int32)
    mask = jnp.ones(tokens_T.shape, bool) if mask_T is None else jnp.asarray(mask_T) > 0
    ref_plan = LogprobPlan(float(temperature), np.dtype(policy.logits_dtype), 1,
                           block_v or BLOCK_V, 1, "reference")
    reference = lambda: _fused(h_TxD, w, tokens, mask, ref_plan)
    tiles = dict(block_t=block_t, block_v=block_v, block_d=block_d, tpu_tiles=tpu_tiles)
    return _by_platform(h_TxD, w, tokens, mask, temperature, policy, reference, tiles)


def readout_logprobs(h_TxD: jax.Array, w_DxV: jax.Array, tokens_T: jax.Array,
                     temperature: float, policy: Policy, *, plain,
                     mask_T: jax.Array | None = None, entropy: bool = True):
    """A model's read-out of the chosen tokens' log-probs (and entropies) from its hidden state.

    The fused kernel of the platform the program is lowered for where one runs
    (`fused_logprobs`' dispatch); where none does, on `cpu` `plain()`, the
    caller's plain path (logits, then `log_softmax`: what a CPU program under
    `kernels=auto` runs, bit for bit what it ran before the kernels existed),
    and on any other platform `tiled_readout`, XLA's scan over vocabulary tiles
    with no `[T, V]` array (on a GPU, whose kernels are retired, that is every
    program). The learner's forward and the SFT loss call this; the sampler and
    the replay read `token_logprobs` of the step's logits. Not jitted itself.

    Args:
      h_TxD, w_DxV, tokens_T, temperature, policy, mask_T: as `fused_logprobs`.
      plain: no-argument closure returning what this returns (`(logp [T],
        entropy [T])`, or `logp [T]` without `entropy`) by the plain path.
      entropy: whether the entropies are wanted.

    Returns:
      `(logp [T] f32, entropy [T] f32)`, or `logp` alone without `entropy`.
      Rows off `mask_T` are 0 from the kernel and whatever `plain` gives.
    """
    policy = require(policy, "readout_logprobs")
    if not fused_readout(policy):
        return plain()
    _check(h_TxD, w_DxV, tokens_T, temperature, policy, None, None, None)
    w = policy.round_params(w_DxV)
    tokens = tokens_T.astype(jnp.int32)
    mask = jnp.ones(tokens_T.shape, bool) if mask_T is None else jnp.asarray(mask_T) > 0
    plain_out = lambda: plain() if entropy else (plain(), jnp.zeros(tokens.shape))
    tiled = lambda: tiled_readout(h_TxD, w, tokens, mask, temperature, policy)
    # Where no kernel runs: the caller's plain path on `cpu`, the tiled scan elsewhere.
    reference = lambda: jax.lax.platform_dependent(cpu=plain_out, default=tiled)
    out = _by_platform(h_TxD, w, tokens, mask, temperature, policy, reference, {})
    return out if entropy else out[0]


def readout_block_v(t: int, v: int) -> int:
    """The vocabulary columns per tile of `tiled_readout` for `t` rows and `v` columns: the
    largest power of two whose `[t, block_v]` f32 tile fits `READOUT_TILE_BYTES`, at least
    `BLOCK_V`, at most `v`."""
    block = BLOCK_V
    while block * 2 * t * 4 <= READOUT_TILE_BYTES and block * 2 <= v:
        block *= 2
    return min(block, v)


def _stored_mm(a, b, spec):
    # `numerics.products`' precision: HIGHEST where an operand is f32, the default on bf16.
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32, precision=precision_for(a, b))


def _readout_forward(h, w, tokens, mask, plan: LogprobPlan):
    """`tiled_readout`'s forward: XLA's scan, or the Mosaic GPU kernel (`plan.impl` "mosaic":
    compiled where lowered for cuda, refused elsewhere; or interpreted anywhere)."""
    xla = lambda: reference_forward(h, w, tokens, mask, plan, _stored_mm)
    if plan.impl != "mosaic":
        return xla()
    if plan.interpret:
        return logprob_mgpu.mgpu_forward(h, w, tokens, mask, plan, interpret=True)
    return jax.lax.platform_dependent(
        cuda=lambda: logprob_mgpu.mgpu_forward(h, w, tokens, mask, plan),
        default=lambda: refuse("tiled_readout(forward='mosaic') is a Mosaic GPU kernel, "
                               "compiled for cuda only; forward='mosaic-interpret' runs it "
                               "anywhere, forward='xla' is XLA's", xla()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _tiled(h, w, tokens, mask, plan: LogprobPlan, policy: Policy):
    return _readout_forward(h, w, tokens, mask, plan)[:2]


def _tiled_fwd(h, w, tokens, mask, plan, policy):
    lp, ent, lse, mean = _readout_forward(h, w, tokens, mask, plan)
    return (lp, ent), (h, w, tokens, mask, lse, mean)


def _tiled_bwd(plan, policy, res, g):
    h, w, tokens, mask, lse, mean = res
    g_lp, g_ent = (jnp.where(mask, x, 0.0) for x in g)
    # The cotangent in the compute dtype, as `numerics.products` rounds the plain path's.
    dh, dw = reference_backward(h, w, tokens, lse, mean, g_lp, g_ent, plan, _stored_mm,
                                policy.round)
    return dh, dw, None, None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


READOUT_FORWARDS = ("xla", "mosaic", "mosaic-interpret")


def tiled_readout(h_TxD: jax.Array, w_DxV: jax.Array, tokens_T: jax.Array, mask_T: jax.Array,
                  temperature: float, policy: Policy, *, forward: str = "xla"):
    """`(logp [T], entropy [T])` read out by XLA over vocabulary tiles of `readout_block_v`
    columns, with no `[T, V]` array: what `readout_logprobs` runs off the CPU where no kernel
    does (every GPU program, whose kernels are retired).

    The online logsumexp of the module docstring, its backward recomputing each tile. The
    products are the plain path's (`models.layers.dot` by `numerics.products`): operands as
    stored (bf16 x bf16 at the platform's default precision on a GPU, f32 accumulation), the
    tile's cotangent rounded to the compute dtype (`policy.round`) before the backward
    products; the weight's gradient is written per tile in its dtype, the hidden state's
    summed over the tiles in f32. Under a mesh each device reads out its rows (`per_shard`).

    `forward="mosaic"` computes the forward (log-probs, entropies and the backward's
    residuals) by the Mosaic GPU kernel instead (`kernels.logprob_mgpu`: compiled when
    lowered for cuda, refused elsewhere; `"mosaic-interpret"` interpreted anywhere), the
    backward still XLA's: a port measured against XLA's read-out on a GPU (`jaxrl-lp bench
    kernels --kernels retired`), no run's path.

    Args:
      h_TxD: the final normed hidden state, compute precision.
      w_DxV: the lm head, already rounded to the policy's matmul input (`round_params`).
      tokens_T: int32 chosen tokens; mask_T: bool, rows read out (others give 0).
      temperature: > 0; policy: its logits dtype rounds each tile.
      forward: one of `READOUT_FORWARDS`.

    Raises:
      ValueError: an unknown `forward`, or a Mosaic one for operands the kernel cannot take
        (`logprob_mgpu.misfit`: bf16 or f16, the hidden size a multiple of 64, the
        vocabulary of 128).
    """
    if forward not in READOUT_FORWARDS:
        raise ValueError(f"tiled_readout: forward is one of {READOUT_FORWARDS}, not {forward!r}")
    t = h_TxD.shape[0]
    shards = shard_count("batch")
    t = t // shards if t % shards == 0 else t
    plan = LogprobPlan(float(temperature), np.dtype(policy.logits_dtype), 1,
                       readout_block_v(t, w_DxV.shape[1]), 1, "reference")
    if forward != "xla":
        why = logprob_mgpu.misfit(*w_DxV.shape, h_TxD.dtype, w_DxV.dtype)
        if why is not None:
            raise ValueError(f"tiled_readout(forward={forward!r}): {why}; forward='xla' takes "
                             "any operands")
        plan = plan._replace(block_t=logprob_mgpu.MGPU_TILES[0],
                             block_v=logprob_mgpu.MGPU_TILES[1],
                             block_d=logprob_mgpu.MGPU_TILES[2], impl="mosaic",
                             interpret=forward == "mosaic-interpret")
    rows = ("batch",)
    run = per_shard(lambda *a: _tiled(*a, plan, policy), (rows + (None,), None, rows, rows),
                    (rows, rows))
    return run(h_TxD, w_DxV, tokens_T, mask_T)
