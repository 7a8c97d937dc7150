"""`CausalLM`: a Flax NNX module around the pure forward functions.

The module is a container: its `nnx.Param`s are the parameter pytree of
docs/design/parameters.md, and every computation is a pure function of that pytree
(`dense_forward`, `looped_forward`). Use it functionally:

    >>> model = CausalLM(get_preset("tiny-qwen3"), rngs=nnx.Rngs(0))
    >>> graphdef, state = nnx.split(model, nnx.Param)
    >>> params = state.to_pure_dict()              # the explicit params pytree
    >>> logits, _ = forward(params, model.config, model.policy, tokens)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.dense import dense_forward
from jaxrl_lp.models.loop import MODEL_DEFAULT, ExitRule, ExitSchedule, LoopSpec
from jaxrl_lp.models.looped import LoopedOutput, looped_forward
from jaxrl_lp.models.packing import Packing
from jaxrl_lp.models.remat import Remat
from jaxrl_lp.numerics.policy import FP32, Policy, require

__all__ = ["CausalLM", "forward", "init_params", "param_shapes"]


def param_shapes(cfg: ModelConfig) -> dict:
    """The parameter pytree of `cfg` as nested dict of shapes (docs/design/parameters.md)."""
    d, f, hd, L = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_layers
    hq, hk = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layers = {
        "q_proj": (L, d, hq), "k_proj": (L, d, hk), "v_proj": (L, d, hk), "o_proj": (L, hq, d),
        "gate_proj": (L, d, f), "up_proj": (L, d, f), "down_proj": (L, f, d),
    }
    if cfg.attention_bias:
        layers.update(q_bias=(L, hq), k_bias=(L, hk), v_bias=(L, hk))
    if cfg.qk_norm:
        layers.update(q_norm=(L, hd), k_norm=(L, hd))
    norms = ("attn_norm_in", "attn_norm_out", "mlp_norm_in", "mlp_norm_out") if cfg.is_looped \
        else ("attn_norm", "mlp_norm")
    layers.update({n: (L, d) for n in norms})
    shapes: dict[str, Any] = {"embed": (cfg.vocab_size, d), "layers": layers, "final_norm": (d,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    if cfg.is_looped:
        shapes["exit_gate"] = {"kernel": (d, 1), "bias": (1,)}
    return shapes


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """Random f32 parameters: normal(0, init_std) matrices, unit norms, zero biases."""
    shapes = param_shapes(cfg)
    paths, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple)
    )
    keys = jax.random.split(key, len(paths))
    leaves = []
    for (path, shape), k in zip(paths, keys, strict=True):
        name = str(path[-1].key)
        if "norm" in name:
            leaves.append(jnp.ones(shape, jnp.float32))
        elif "bias" in name:
            leaves.append(jnp.zeros(shape, jnp.float32))
        else:
            leaves.append(cfg.init_std * jax.random.normal(k, shape, jnp.float32))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def forward(params: dict, cfg: ModelConfig, policy: Policy, tokens_BxT: jax.Array,
            positions_BxT: jax.Array | None = None, cache: dict | None = None,
            cache_index: jax.Array | int = 0, *, loop: LoopSpec | None = None,
            schedule: ExitSchedule | None = None, readout: str = "exit",
            early_stop: bool = False, remat: Remat | bool = False, hidden: bool = False,
            packing: Packing | None = None, tape: dict | None = None):
    """Dispatches to `dense_forward` or `looped_forward`; returns (logits, cache, LoopedOutput|None).

    For looped models the third element is the full `LoopedOutput` (exit steps,
    exit distribution, loop evaluations); for dense models it is None. `loop`,
    `schedule`, `readout` and `early_stop` are the looped forward's (see
    `looped_forward`); a dense model ignores `loop` and refuses the others.
    With `hidden` the first element is the final normed hidden state [B, T, D]
    that the lm head reads (the input of `kernels.fused_logprobs`). `packing`
    computes the packed rows only (`models.packing`; no cache): the outputs
    are then `[S, M, ...]` (`dense_forward`, `looped_forward`). `tape`
    receives a dense model's weight products (`dense_forward`).
    Not jitted itself; the options are Python values, static for the caller.
    """
    policy = require(policy, "forward")
    if cfg.is_looped and tape is not None:
        raise ValueError("forward: tape (recorded weight products) is for dense models")
    if cfg.is_looped:
        out: LoopedOutput = looped_forward(
            params, cfg, policy, tokens_BxT, positions_BxT, cache, cache_index, loop=loop,
            schedule=schedule, readout=readout, early_stop=early_stop, remat=remat,
            hidden=hidden, packing=packing)
        return out.logits, out.cache, out
    if schedule is not None or readout != "exit" or early_stop:
        raise ValueError("schedule, readout='expected' and early_stop apply to looped models only")
    logits, cache = dense_forward(params, cfg, policy, tokens_BxT, positions_BxT, cache,
                                  cache_index, remat=remat, hidden=hidden, packing=packing,
                                  tape=tape)
    return logits, cache, None


class _Tree(nnx.Module):
    """A node of the parameter tree: arrays become `nnx.Param`s, dicts become `_Tree`s."""

    def __init__(self, tree: dict):
        for k, v in tree.items():
            setattr(self, k, _Tree(v) if isinstance(v, dict) else nnx.Param(jnp.asarray(v)))


class CausalLM(nnx.Module):
    """A causal language model (dense Qwen3-family or looped Ouro-family).

    Args:
      config: the architecture.
      params: a parameter pytree (docs/design/parameters.md); random if None.
      policy: the precision policy used by `__call__` (a `Policy` or its string).
      rngs: initialization randomness when `params` is None.

    Calling the model on int tokens [B, T] returns f32 logits [B, T, V]; looped
    models read out by `config.exit_rule` unless told otherwise, which for a
    loaded Ouro checkpoint is where its reference code reads out.
    """

    def __init__(self, config: ModelConfig, params: dict | None = None, *,
                 policy: Policy = FP32, rngs: nnx.Rngs | None = None):
        self.config = config
        self.policy = require(policy, "Model")
        if params is None:
            rngs = rngs if rngs is not None else nnx.Rngs(0)
            params = init_params(config, rngs.params())
        _check_tree(param_shapes(config), params)
        for k, v in params.items():
            setattr(self, k, _Tree(v) if isinstance(v, dict) else nnx.Param(jnp.asarray(v)))

    def params(self) -> dict:
        """The parameter pytree as a plain nested dict of arrays."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))

    def __call__(self, tokens_BxT: jax.Array, *, exit_rule: ExitRule | str = MODEL_DEFAULT,
                 readout: str = "exit") -> jax.Array:
        """Logits [B, T, V] f32; `exit_rule` and `readout` apply to looped models only."""
        looped = self.config.is_looped
        logits, _, _ = forward(self.params(), self.config, self.policy,
                               jnp.asarray(tokens_BxT, jnp.int32),
                               loop=LoopSpec(str(exit_rule)) if looped else None,
                               readout=readout if looped else "exit")
        return logits


def _check_tree(shapes: dict, params: dict, prefix: str = "") -> None:
    """Raises a ValueError naming the first missing, extra or mis-shaped tensor."""
    missing = sorted(set(shapes) - set(params))
    extra = sorted(set(params) - set(shapes))
    if missing or extra:
        raise ValueError(
            f"parameter tree does not match the config at {prefix or '<root>'}: "
            f"missing {missing}, unexpected {extra}"
        )
    for k, s in shapes.items():
        name = f"{prefix}{k}"
        if isinstance(s, dict):
            if not isinstance(params[k], dict):
                raise ValueError(f"parameter {name!r} should be a subtree")
            _check_tree(s, params[k], name + "/")
        elif tuple(np.shape(params[k])) != s:
            raise ValueError(f"parameter {name!r} has shape {tuple(np.shape(params[k]))}, "
                             f"expected {s}")
