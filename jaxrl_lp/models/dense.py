"""The dense decoder (Qwen3 family; Qwen2 with attention biases) as a pure function."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_lp.models.blocks import (
    attend,
    attend_packed,
    embed,
    lm_logits,
    mlp,
    over_layers,
    project_qkv,
    residual_add,
)
from jaxrl_lp.models.cache import write_positions
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.layers import rms_norm
from jaxrl_lp.models.packing import Packing, pack
from jaxrl_lp.models.remat import Remat, remat_layer
from jaxrl_lp.numerics.policy import Policy

__all__ = ["dense_forward", "default_positions"]


def default_positions(tokens_BxT: jax.Array, cache_index=0) -> jax.Array:
    """Positions `cache_index + [0, T)` for every sequence."""
    b, t = tokens_BxT.shape
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None] + cache_index, (b, t))


def dense_forward(
    params: dict,
    cfg: ModelConfig,
    policy: Policy,
    tokens_BxT: jax.Array,
    positions_BxT: jax.Array | None = None,
    cache: dict | None = None,
    cache_index: jax.Array | int = 0,
    *,
    remat: Remat | bool = False,
    hidden: bool = False,
    packing: Packing | None = None,
    tape: dict | None = None,
) -> tuple[jax.Array, dict | None]:
    """Logits of a dense decoder, reading and writing an optional KV cache.

    The same function serves the full forward (no cache), prefill and one-token
    decode (with a cache), so the sampler and the learner's replay run one
    computation. Stacked layers are scanned (`lax.scan`), so compile time does
    not grow with depth; unstacked ones (`unstack_layers`, what the sampler
    decodes with) run as straight-line code, reading each weight in place.

    Args:
      params: the parameter pytree (docs/design/parameters.md), layers stacked or unstacked.
      cfg: the architecture.
      policy: the numerics.
      tokens_BxT: int token ids.
      positions_BxT: int positions; -1 marks padding (never attended to).
        Default `cache_index + arange(T)`.
      cache: from `models.init_cache`, or None for a cache-free forward.
      cache_index: slot at which this chunk is written.
      remat: what each layer's backward recomputes (`models.remat.Remat`; `True` is
        `layers`).
      hidden: return the final normed hidden state [B, T, D] (compute
        precision, what the lm head reads) instead of the logits, for the
        fused log-prob (`kernels.logprob`).
      packing: compute only these slots (`models.packing`; no cache): the
        embedding, projections, norms and MLP run on the M packed rows, and
        attention on the [B, T] grid with zeros at the other slots, which no
        packed query may see (the caller's promise: they are padding, masked
        by position -1 or after the row's last packed token). The outputs are
        then packed rows, [S, M, V] or [S, M, D] (S groups, `Packing.groups`).
      tape: a dict that receives every layer's weight products, stacked over
        the layers: `{name: [L, B, T, out]}` f32 for `models.recorded`'s
        `LAYER_PRODUCTS` (what the sampler records; not with `packing` or
        `remat`).

    Returns:
      (logits [B, T, V] f32 or the hidden state, the updated cache or None).
    """
    cache_index = jnp.asarray(cache_index, jnp.int32)
    if positions_BxT is None:
        positions_BxT = default_positions(tokens_BxT, cache_index)
    if tape is not None and (packing is not None or Remat.of(remat) is not Remat.NONE):
        raise ValueError("dense_forward: tape records an unpacked forward without remat")
    if packing is not None:
        if cache is not None:
            raise ValueError("dense_forward: a packed forward has no KV cache")
        return _packed_forward(params, cfg, policy, tokens_BxT, positions_BxT, packing,
                               remat=remat, hidden=hidden), None
    h = embed(params, tokens_BxT, policy)
    if cache is not None:
        cache = write_positions(cache, positions_BxT, cache_index)
    pos_slots = None if cache is None else cache["pos"]

    def layer(carry, xs):
        h, ck, cv = carry
        lp, l = xs
        taped = None if tape is None else {}
        x = rms_norm(h, lp["attn_norm"], cfg.rms_eps, policy)
        q, k, v = project_qkv(lp, x, positions_BxT, cfg, policy, taped)
        a, kv = attend(lp, q, k, v, positions_BxT, policy, None if ck is None else (ck, cv), l,
                       (), cache_index, pos_slots, taped)
        ck, cv = (None, None) if kv is None else kv
        h = residual_add(h, a, policy)
        h = residual_add(h, mlp(lp, rms_norm(h, lp["mlp_norm"], cfg.rms_eps, policy), policy,
                                taped), policy)
        return (h, ck, cv), taped

    layer = remat_layer(layer, remat)
    ck = None if cache is None else cache["k"]
    cv = None if cache is None else cache["v"]
    (h, ck, cv), taped = over_layers(layer, (h, ck, cv), params["layers"])
    if tape is not None:
        tape.update(taped)
    if cache is not None:
        cache = {**cache, "k": ck, "v": cv}
    h = rms_norm(h, params["final_norm"], cfg.rms_eps, policy)
    return (h if hidden else lm_logits(params, h, cfg, policy)), cache


def _packed_forward(params, cfg: ModelConfig, policy: Policy, tokens_BxT, positions_BxT,
                    packing: Packing, *, remat: Remat | bool, hidden: bool) -> jax.Array:
    """`dense_forward` on the packed rows only (its `packing` argument): [S, M, V] or [S, M, D]."""
    pos_SxM = pack(positions_BxT, packing)
    h = embed(params, pack(tokens_BxT, packing), policy)  # [S, M, D]

    def layer(h, xs):
        lp, _ = xs
        x = rms_norm(h, lp["attn_norm"], cfg.rms_eps, policy)
        q, k, v = project_qkv(lp, x, pos_SxM, cfg, policy)
        a = attend_packed(lp, q, k, v, positions_BxT, policy, packing)
        h = residual_add(h, a, policy)
        h = residual_add(h, mlp(lp, rms_norm(h, lp["mlp_norm"], cfg.rms_eps, policy), policy),
                         policy)
        return h, None

    layer = remat_layer(layer, remat)
    h, _ = over_layers(layer, h, params["layers"])
    h = rms_norm(h, params["final_norm"], cfg.rms_eps, policy)
    return h if hidden else lm_logits(params, h, cfg, policy)
