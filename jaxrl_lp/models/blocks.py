"""The attention and MLP blocks shared by the dense and looped decoders.

`lp` is one layer's slice of `params["layers"]` (see docs/design/parameters.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# The module, not its function: the kernel module imports `models.layers`, so either
# package may be the one still initializing when the other is imported.
from jaxrl_lp.kernels import decode_attention as decode_kernel
from jaxrl_lp.kernels.fake_quant import INVARIANT_FORMATS, QUANTIZED_WEIGHT_FORMATS
from jaxrl_lp.kernels.quantize import dequantize, quantize
from jaxrl_lp.models.attention import attention
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.layers import TransposedWeight, dot, rms_norm, rope, swiglu
from jaxrl_lp.models.packing import Packing, pack, unpack
from jaxrl_lp.models.recorded import LAYER_PRODUCTS
from jaxrl_lp.numerics import invariant
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.numerics.qarray import QArray
from jaxrl_lp.parallel.context import constrain

# Logical axes of the activations (`parallel.rules`): the residual stream is
# batch-sharded and whole; heads and MLP columns follow the tensor axis.
RESIDUAL = ("batch", "sequence", "hidden")

__all__ = [
    "attend", "attend_packed", "decode_weights", "embed", "kv_heads_first", "lm_head", "lm_logits", "mlp",
    "MATMUL_WEIGHTS", "over_layers", "project_qkv", "residual_add", "unstack_layers",
]


# A layer's matmul weights `[in, out]`, the ones `unstack_layers(transpose=True)` copies
# `[out, in]`: the seven whose products the sampler can record.
MATMUL_WEIGHTS = LAYER_PRODUCTS


def _layer_of(x, i: int):
    """Layer `i` of a stacked leaf; a `QArray`'s block axis and batch axes then count from
    the layer's own axes (one axis fewer)."""
    if not isinstance(x, QArray):
        return x[i]
    return dataclasses.replace(jax.tree.map(lambda a: a[i], x), axis=max(x.axis - 1, 0),
                               batch_axes=tuple(b - 1 for b in x.batch_axes if b > 0))


def unstack_layers(params: dict, *, transpose: bool = False, policy: Policy | None = None) -> dict:
    """`params` with `layers` as a tuple of per-layer dicts (for decoding).

    The forward functions accept either form and compute the same thing. A
    scan over stacked weights slices one layer per iteration, which XLA on CPU
    materializes as a copy of every weight on every decode step; unstacked
    weights, sliced once before the decode loop, are read in place. Layer
    loops then unroll, so compile time grows with depth.

    `transpose=True` (the decode layout `transposed`, `rollout.step.decode_layout`):
    each layer's plain matmul weights (`MATMUL_WEIGHTS`, not LoRA or quantized
    leaves) are sliced as `[out, in]` copies and the lm head is `[V, D]`,
    each a `layers.TransposedWeight` (a tied head is the embedding itself, no
    copy); `dot` multiplies them weights-major. Same values, other sums.

    With a `policy`, the weights are first rounded once as the forward reads
    them (`decode_weights`), so a decode loop reads the matmul inputs (bf16 on
    a GPU) instead of converting the f32 master on every step.

    `transpose=True` under a policy whose `matmul_format` is one of
    `kernels.fake_quant.INVARIANT_FORMATS` (the invariant forms' weights-major read, the
    only one that takes it): each copy holds the values of the weight quantized along `in`,
    `Q(w)`, `[out, in]`, in f32 (`TransposedWeight.format`), the head too, so the loop
    quantizes no weight and transposes none.
    """
    if policy is not None:
        params = decode_weights(params, policy)
    layers = params["layers"]
    if isinstance(layers, tuple):  # unstacked already, in the layout they were unstacked in
        return params
    n = jax.tree_util.tree_leaves(layers)[0].shape[0]
    fmt = None if policy is None else policy.matmul_format
    if transpose and fmt is not None and fmt not in INVARIANT_FORMATS:
        raise ValueError(f"unstack_layers: an [out, in] copy of a {fmt} weight is for the "
                         f"invariant forms, whose formats are {INVARIANT_FORMATS}")

    def copy_of(w_KxN):  # the `[out, in]` copy a product of this policy reads
        if fmt is None:
            return TransposedWeight(jnp.swapaxes(w_KxN, 0, 1))
        # As the product quantizes a weight: rounded first (again where `decode_weights`
        # rounded: rounding there is idempotent, and where it does not round, this is once).
        q = w_KxN if isinstance(w_KxN, QArray) else quantize(policy.round_params(w_KxN), fmt,
                                                             0, kernels=policy.kernels)
        return TransposedWeight(jnp.swapaxes(dequantize(q, kernels=policy.kernels), 0, 1), fmt)

    def layer(i):
        lp = jax.tree.map(lambda x: _layer_of(x, i), layers,
                          is_leaf=lambda x: isinstance(x, QArray))
        if transpose:
            lp = {k: copy_of(v) if k in MATMUL_WEIGHTS and (
                isinstance(v, jax.Array) or fmt is not None and isinstance(v, QArray)) else v
                  for k, v in lp.items()}
        return lp

    out = {**params, "layers": tuple(layer(i) for i in range(n))}
    if transpose:
        # The head `[V, D]`: an untied head's copy, or (tied: no `lm_head`) the embedding.
        head = params.get("lm_head", params["embed"])
        if fmt is not None and isinstance(head, (jax.Array, QArray)):
            out["lm_head"] = copy_of(head if isinstance(head, QArray) or "lm_head" in params
                                     else head.T)
        elif isinstance(head, jax.Array):
            out["lm_head"] = TransposedWeight(head.T if "lm_head" in params else head)
    return out


def decode_weights(params: dict, policy: Policy) -> dict:
    """`params` with every weight the forward reads through `policy.round_params` rounded once.

    Those are the plain arrays of each layer (matmul weights, norms, biases),
    the embedding, the head, the final norm and a looped model's exit-gate
    kernel (its bias is read in f32 and kept). Rounding is idempotent here
    (`param_dtype` is f32 or the compute dtype), so the forward computes the
    same bits from the copy as from `params`; it only stops re-rounding the
    master inside a decode loop. Under a `matmul_format` of
    `kernels.fake_quant.QUANTIZED_WEIGHT_FORMATS` (per-tensor FP8, MXFP8, MXFP4) each
    layer's matmul weights (`MATMUL_WEIGHTS`) and the head are also quantized once along
    their contraction axis (a per-tensor format: one scale a layer): the `QArray` `Q(w)`
    that `dot` would compute on every step, which it takes as it is (an FP8 format's as
    codes, an FP8 GEMM on a GPU; the others' values rebuilt from the codes), so the loop
    reads the codes (1 byte a weight, half a byte in MXFP4) and quantizes no weight (a tied
    head gets a quantized `lm_head` of its own, `[D, V]`). NVFP4 keeps quantizing each step
    (`QUANTIZED_WEIGHT_FORMATS` says why). LoRA and quantized leaves pass as they are; so
    do the params under another `param_dtype` (f16 params for bf16 compute would round twice
    otherwise).
    """
    if policy.param_dtype not in (np.dtype(np.float32), policy.compute_dtype) or (
            not policy.is_low_precision and policy.param_dtype == np.dtype(np.float32)):
        return params

    def rnd(x):
        plain = isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
        return policy.round_params(x) if plain else x

    fmt = policy.matmul_format if policy.matmul_format in QUANTIZED_WEIGHT_FORMATS else None

    def rnd_weight(x):  # a matmul weight `[..., in, out]` along `in`, a layer a tensor
        if fmt is None or not isinstance(x, jax.Array):
            return rnd(x)
        return quantize(rnd(x), fmt, x.ndim - 2, tuple(range(x.ndim - 2)),
                        kernels=policy.kernels)

    def rnd_layer(lp: dict) -> dict:
        return {k: rnd_weight(v) if k in MATMUL_WEIGHTS else rnd(v) for k, v in lp.items()}

    layers = params["layers"]
    out = {**params, "layers": (tuple(rnd_layer(lp) for lp in layers)
                                if isinstance(layers, tuple) else rnd_layer(layers))}
    for k in ("embed", "lm_head", "final_norm"):
        if k in params:
            out[k] = rnd(params[k])
    head = params.get("lm_head", params["embed"])
    if fmt is not None and isinstance(head, jax.Array):
        # The head `[D, V]` quantized; a tied one (the embedding) gets a copy of its own.
        out["lm_head"] = rnd_weight(head if "lm_head" in params else head.T)
    if "exit_gate" in params:
        out["exit_gate"] = {**params["exit_gate"], "kernel": rnd(params["exit_gate"]["kernel"])}
    return out


def over_layers(layer_fn, carry, layers, xs=()):
    """Runs `layer_fn` over the layers: a `lax.scan` when stacked, a Python loop when unstacked.

    `layer_fn(carry, (lp, l, *xs_l))` gets one layer's weights `lp`, its index
    `l` (an int32 scalar when scanned, a Python int when unstacked) and its
    slice of each array in `xs` (leading layer axis). `layers` is the stacked
    per-layer dict or `unstack_layers`' tuple. Returns (carry, the per-layer
    outputs stacked).
    """
    if not isinstance(layers, tuple):
        n = jax.tree_util.tree_leaves(layers)[0].shape[0]
        return jax.lax.scan(layer_fn, carry, (layers, jnp.arange(n, dtype=jnp.int32), *xs))
    ys = []
    for i, lp in enumerate(layers):
        carry, y = layer_fn(carry, (lp, i, *(jax.tree.map(lambda a, i=i: a[i], x) for x in xs)))
        ys.append(y)
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)


def embed(params: dict, tokens_BxT: jax.Array, policy: Policy) -> jax.Array:
    """Embedding lookup, rounded to compute precision (f32 when the residual is f32)."""
    # The table is gathered along its FSDP axis for the lookup (as every FSDP weight is
    # before use); its vocabulary stays split over `tensor`.
    table = constrain(params["embed"], ("vocab", "hidden"))
    x = policy.round_params(jnp.take(table, tokens_BxT, axis=0))
    return constrain(x.astype(jnp.float32) if policy.has("residual") else x, RESIDUAL)


def residual_add(h: jax.Array, delta: jax.Array, policy: Policy) -> jax.Array:
    """h + delta: kept f32 with the `residual` region, else rounded to compute precision."""
    if policy.has("residual"):
        return h + delta.astype(jnp.float32)
    return policy.round(h + delta)


def project_qkv(lp: dict, x_BxTxD: jax.Array, positions_BxT: jax.Array,
                cfg: ModelConfig, policy: Policy, tape: dict | None = None):
    """Query, key and value of one layer: projections, optional bias and QK-norm, RoPE.

    Returns q [B,T,H,Dh], k and v [B,T,K,Dh], all in compute precision. With
    `tape` (a dict) the three products (`dot`'s f32 accumulators) are stored
    in it under their weights' names, as Flax's `sow` keeps intermediates
    (`models.recorded`).
    """
    b, t, _ = x_BxTxD.shape
    hd = cfg.head_dim

    def proj(name, heads):
        acc = dot(x_BxTxD, lp[f"{name}_proj"], policy)
        if tape is not None:
            tape[f"{name}_proj"] = acc
        if cfg.attention_bias:
            acc = acc + policy.round_params(lp[f"{name}_bias"]).astype(jnp.float32)
        return policy.round(acc).reshape(b, t, heads, hd)

    q = proj("q", cfg.num_heads)
    k = proj("k", cfg.num_kv_heads)
    v = proj("v", cfg.num_kv_heads)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_eps, policy)
        k = rms_norm(k, lp["k_norm"], cfg.rms_eps, policy)
    q = rope(q, positions_BxT, cfg.rope_theta, policy)
    k = rope(k, positions_BxT, cfg.rope_theta, policy)
    return (constrain(q, ("batch", "sequence", "heads", "head_dim")),
            constrain(k, ("batch", "sequence", "kv_heads", "head_dim")),
            constrain(v, ("batch", "sequence", "kv_heads", "head_dim")))


def attend(lp: dict, q, k, v, positions_BxT, policy: Policy, cache_kv=None, layer=0, lead=(),
           cache_index=0, pos_slots_BxS=None, tape: dict | None = None):
    """Attention output projected by o_proj (f32 accumulator rounded), and the updated cache.

    Without `cache_kv` the keys are this chunk's own tokens. With `cache_kv`, the
    cache's (`k`, `v`) pair (`models.cache`: whole arrays `[*lead, L, B, K, S,
    Dh]`, or per-layer tuples of `[*lead, B, K, S, Dh]`), the chunk is written
    in place at slots `cache_index + [0, T)` of `(*lead, layer)` and the queries
    read every visible slot there (slot positions `pos_slots_BxS`). The whole
    cache rides through the layer (and loop) loops and is written in place, so
    no step restacks it; reading one layer out of a stacked cache is still a
    copy on CPU, which per-layer buffers (`unstack_cache`) avoid. With
    per-layer buffers `layer` must be a Python int. A one-token chunk (the
    decode step) reads the cache by `kernels.decode_attention`, the Pallas
    flash-decoding kernel where `policy.kernels` picks it (else the same
    `attention` as any other chunk).

    With `tape` the `o_proj` product is stored in it (`project_qkv`).

    Returns (output [B, T, D], the updated `cache_kv` or None).
    """
    k_heads, v_heads = kv_heads_first(k), kv_heads_first(v)
    if cache_kv is None:
        o = attention(q, k_heads, v_heads, positions_BxT, positions_BxT, policy)
        return _project_out(o, lp, policy, tape), None
    ck, cv = cache_kv
    per_layer = isinstance(ck, tuple)
    at = lead if per_layer else (*lead, layer)
    buf_k, buf_v = (ck[layer], cv[layer]) if per_layer else (ck, cv)
    buf_k = _write(buf_k, k_heads, at, cache_index)
    buf_v = _write(buf_v, v_heads, at, cache_index)
    # Inside `invariant_forms` every chunk reads the cache by `attention`'s invariant form, so
    # a decode step and a parallel forward over the same slots agree.
    one_token = q.shape[1] == 1 and not invariant.active()
    attn = decode_kernel.decode_attention if one_token else attention
    o = attn(q, _read(buf_k, at), _read(buf_v, at), positions_BxT, pos_slots_BxS, policy)
    if per_layer:
        buf_k = (*ck[:layer], buf_k, *ck[layer + 1:])
        buf_v = (*cv[:layer], buf_v, *cv[layer + 1:])
    return _project_out(o, lp, policy, tape), (buf_k, buf_v)


def _project_out(o_BxTxHDh, lp: dict, policy: Policy, tape: dict | None) -> jax.Array:
    """o_proj of the attention output, rounded to compute precision (its product taped)."""
    acc = dot(o_BxTxHDh, lp["o_proj"], policy)
    if tape is not None:
        tape["o_proj"] = acc
    return constrain(policy.round(acc), RESIDUAL)


def attend_packed(lp: dict, q, k, v, positions_BxT, policy: Policy, packing: Packing):
    """`attend` without a cache on packed rows (`models.packing`): output [S, M, D].

    q [S, M, H, Dh], k and v [S, M, K, Dh] are put back on the `[B, T]` grid
    (zeros at the slots not packed, which no packed query may see: the
    caller's promise that they are padding, masked by position -1 or after
    the row's last packed token), attention runs there, and its output is
    packed again for `o_proj`.
    """
    b, t = positions_BxT.shape
    q, k, v = (constrain(unpack(a, packing, b, t, (heads, "head_dim")),
                         ("batch", "sequence", heads, "head_dim"))
               for a, heads in ((q, "heads"), (k, "kv_heads"), (v, "kv_heads")))
    o = attention(q, kv_heads_first(k), kv_heads_first(v), positions_BxT, positions_BxT, policy)
    return constrain(policy.round(dot(pack(o, packing, ("heads",)), lp["o_proj"], policy)),
                     RESIDUAL)


def _write(buf, chunk_BxKxTxDh, at, cache_index):
    """`buf[(*at, :, :, cache_index + [0, T), :)] = chunk`, in place."""
    zero = jnp.zeros((), jnp.int32)
    start = (*(jnp.asarray(i, jnp.int32) for i in at), zero, zero,
             jnp.asarray(cache_index, jnp.int32), zero)
    return jax.lax.dynamic_update_slice(
        buf, chunk_BxKxTxDh.reshape((1,) * len(at) + chunk_BxKxTxDh.shape).astype(buf.dtype),
        start)


def _read(buf, at):
    """`buf[at]`: one layer's `[B, K, S, Dh]` slots (no slicing when `at` is empty)."""
    if not at:
        return buf
    zero = jnp.zeros((), jnp.int32)
    start = (*(jnp.asarray(i, jnp.int32) for i in at), zero, zero, zero, zero)
    inner = buf.shape[len(at):]
    return jax.lax.dynamic_slice(buf, start, (1,) * len(at) + inner).reshape(inner)


def kv_heads_first(x_BxTxKxDh: jax.Array) -> jax.Array:
    """[B, T, K, Dh] -> [B, K, T, Dh], the cache's layout (each head's slots contiguous)."""
    return jnp.swapaxes(x_BxTxKxDh, 1, 2)


def mlp(lp: dict, x_BxTxD: jax.Array, policy: Policy, tape: dict | None = None) -> jax.Array:
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), output in compute precision.

    With `tape` its three products are stored in it (`project_qkv`).
    """
    gate, up = dot(x_BxTxD, lp["gate_proj"], policy), dot(x_BxTxD, lp["up_proj"], policy)
    hidden = constrain(swiglu(gate, up, policy), ("batch", "sequence", "mlp"))
    down = dot(hidden, lp["down_proj"], policy)
    if tape is not None:
        tape.update(gate_proj=gate, up_proj=up, down_proj=down)
    return constrain(policy.round(down), RESIDUAL)


def lm_head(params: dict, cfg: ModelConfig) -> jax.Array:
    """The output matrix `[D, V]`: `lm_head`, or the embedding transposed when tied.

    In a decode copy the head is the one there, tied or not: the
    `TransposedWeight` of `unstack_layers(transpose=True)`, or the quantized `QArray`
    of `decode_weights` under a per-tensor FP8 `matmul_format`.
    """
    if isinstance(params.get("lm_head"), (TransposedWeight, QArray)):
        return params["lm_head"]
    return params["embed"].T if cfg.tie_embeddings else params["lm_head"]


def lm_logits(params: dict, h_xD: jax.Array, cfg: ModelConfig, policy: Policy) -> jax.Array:
    """Output logits from the final normed hidden state, f32 (rounded to `logits_dtype`)."""
    w = lm_head(params, cfg)
    logits = policy.round_logits(dot(h_xD, w, policy))
    # Rows first: [B, T, V], or [rows, V] (a decode step's [B, V], flattened chunks), whose
    # rows are the batch's (left whole, every device would compute every row's logits).
    axes = ("batch", "sequence", "vocab") if logits.ndim == 3 else ("batch", "vocab")
    return constrain(logits, axes[-logits.ndim:])
