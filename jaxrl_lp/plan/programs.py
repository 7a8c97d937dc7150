"""Every program a run compiles, built on abstract inputs at a model's real size, one device.

`build_program(name, cfg, policy)` returns `(jitted, args)`: the jitted
function exactly as the training program, the sampler or the sync hooks jit
it, and `jax.ShapeDtypeStruct` arguments (nothing allocated), so
`kernels.lowering` can lower it for `cpu`, `cuda` and `tpu` from any host.
Low-precision compute dtypes are stored natively, as on a GPU or TPU, unless the
policy forces the f32 carrier (`native`: a policy's `storage=auto` becomes
`native`). The programs (`PROGRAMS`):

- `grpo_step_dense`, `grpo_step_hybrid`: one GRPO optimizer update
  (`make_grpo_step`, clipped AdamW) with dense or hybrid learner log-probs; a
  dense model's step packed at the full grid (its largest bucket).
- `sft_step`: one supervised update (`make_sft_step`).
  The updates (`UPDATES`) are built with `remat` (`models.remat`; default none).
- `behaviour_logprobs`: the learner's log-probs of a whole batch before the
  updates (`jit_learner_logprobs`, hybrid: the replay alone), where the
  training program does not take the rollout's (`grpo.replay`).
- `sampler_prefill`, `sampler_decode`: the sampler's prompt prefill and one
  decode step (`rollout.step`) over a per-layer KV cache, with the token
  sampled and its log-prob.
- `replay`: the learner's replay of a rollout (`jit_learner_logprobs`, replay).
- `speculative_verify`: one speculative verification, a chunk of k + 1 tokens
  through the target (`rowwise_forward`) and their log-probs (`chunk_logprobs`).
- `exporter`: the policy's weight export (bf16 stochastic rounding for `bf16`,
  the block quantizer for an MX or NVFP4 policy).
- `sync_checks`: the jitted sync checks, re-quantizing the served weights
  (check 6) and the probe forward (check 7).

Sizes (`ProgramShapes`): 8 rows of a 256-slot prompt and 512 new tokens,
k = 4 drafts; a looped model runs its own exit rule in dense mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxrl_lp.models.blocks import unstack_layers
from jaxrl_lp.models.cache import init_cache, unstack_cache
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.model import init_params
from jaxrl_lp.models.remat import Remat
from jaxrl_lp.numerics.policy import Policy, require

__all__ = ["PROGRAMS", "UPDATES", "ProgramShapes", "build_program", "native"]

UPDATES = ("grpo_step_dense", "grpo_step_hybrid", "sft_step")
PROGRAMS = ("grpo_step_dense", "grpo_step_hybrid", "sft_step", "behaviour_logprobs",
            "sampler_prefill", "sampler_decode", "replay", "speculative_verify", "exporter",
            "sync_checks")


class ProgramShapes(NamedTuple):
    """The sizes the programs are built at."""

    rows: int = 8  # B, sequences of a minibatch / the sampler's batch
    prompt_len: int = 256  # P, padded prompt slots
    max_new: int = 512  # N, completion slots
    drafts: int = 4  # k, speculative drafts per verification


def native(policy: Policy) -> Policy:
    """`policy` stored as on a GPU or TPU: `storage=auto` becomes `native`; a forced
    storage stays."""
    return policy.replace(storage="native") if policy.storage == "auto" else policy


def _s(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: _s(x.shape, x.dtype), tree)


def _params(cfg: ModelConfig):
    """The f32 master parameters, stacked layers."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))


def _rollout(cfg: ModelConfig, policy: Policy, loop, shp: ProgramShapes, temperature=1.0):
    from jaxrl_lp.rollout.generate import Rollout

    b, p, n = shp.rows, shp.prompt_len, shp.max_new
    i32, f32 = jnp.int32, jnp.float32
    return Rollout(prompt_tokens=_s((b, p), i32), prompt_lengths=_s((b,), i32),
                   completion_tokens=_s((b, n), i32), completion_mask=_s((b, n), f32),
                   logprobs=_s((b, n), f32), exit_steps=_s((b, n), i32), loop_evals=_s((), i32),
                   weights_version=_s((), i32), policy=policy, loop=loop,
                   temperature=temperature)


def _loop(cfg: ModelConfig):
    from jaxrl_lp.rollout.step import LoopSpec

    return LoopSpec().resolve(cfg)


def _grpo(method: str):
    def build(cfg: ModelConfig, policy: Policy, shp: ProgramShapes, remat: Remat = Remat.NONE):
        from jaxrl_lp.rl.loss import LossConfig
        from jaxrl_lp.rl.train_step import make_grpo_step

        opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-6))
        loop = _loop(cfg)
        step = make_grpo_step(cfg, policy, LossConfig(), opt, loop=loop, method=method,
                              remat=remat)
        params = _params(cfg)
        b, n = shp.rows, shp.max_new
        args = (params, _abstract(jax.eval_shape(opt.init, params)),
                _rollout(cfg, policy, loop, shp), _s((b,), jnp.float32), _s((b, n), jnp.float32))
        if step.packs:  # its largest bucket: every slot real
            return step.with_packed_rows((b * (shp.prompt_len + n), b * n)), args
        return step, args
    return build


def _sft(cfg: ModelConfig, policy: Policy, shp: ProgramShapes, remat: Remat = Remat.NONE):
    from jaxrl_lp.rl.train_step import make_sft_step

    opt = optax.adamw(1e-5)
    step = make_sft_step(cfg, policy, opt, remat=remat)
    params = _params(cfg)
    b, l = shp.rows, shp.prompt_len + shp.max_new
    args = (params, _abstract(jax.eval_shape(opt.init, params)), _s((b, l), jnp.int32),
            _s((b, l), jnp.float32))
    if step.packs:  # its largest bucket, as the GRPO step's
        return step.with_packed_rows((b * l, b * (l - 1))), args
    return step, args


def _learner_logprobs(method: str):
    def build(cfg: ModelConfig, policy: Policy, shp: ProgramShapes):
        from jaxrl_lp.rl.logprob_programs import jit_learner_logprobs

        loop = _loop(cfg)
        fn = jit_learner_logprobs(cfg, policy, method, loop=loop)
        return fn, (_params(cfg), _rollout(cfg, policy, loop, shp))
    return build


def _sampler_state(cfg: ModelConfig, policy: Policy, shp: ProgramShapes):
    """The sampler's per-layer weights and per-layer KV cache, abstract."""
    params = jax.eval_shape(unstack_layers, _params(cfg))
    cache = jax.eval_shape(lambda: unstack_cache(
        init_cache(cfg, policy, shp.rows, shp.prompt_len + shp.max_new + shp.drafts + 1), cfg))
    return params, cache


def _pick(params, cfg, policy, out, key):
    """The sampler's token choice and recorded log-prob (`generate`'s `pick`)."""
    from jaxrl_lp.rollout.sampling import SamplingConfig, sample_tokens
    from jaxrl_lp.rollout.step import step_logits

    return sample_tokens(step_logits(params, cfg, policy, out), key, SamplingConfig(temperature=1.0))


def _prefill(cfg: ModelConfig, policy: Policy, shp: ProgramShapes):
    from jaxrl_lp.rollout.step import fused_readout, prefill

    loop, fused = _loop(cfg), fused_readout(policy)

    def run(params, prompt_BxP, positions_BxP, cache, key):
        out, cache, exits, _ = prefill(params, cfg, policy, loop, prompt_BxP, positions_BxP,
                                       cache, hidden=fused)
        return _pick(params, cfg, policy, out, key), cache, exits

    params, cache = _sampler_state(cfg, policy, shp)
    b, p = shp.rows, shp.prompt_len
    return jax.jit(run, donate_argnums=(3,)), (params, _s((b, p), jnp.int32),
                                               _s((b, p), jnp.int32), cache, jax.random.key(0))


def _decode(cfg: ModelConfig, policy: Policy, shp: ProgramShapes):
    from jaxrl_lp.rollout.step import decode_step, fused_readout

    loop, fused = _loop(cfg), fused_readout(policy)

    def run(params, tokens_B, positions_B, cache, index, key):
        out, cache, exits, _ = decode_step(params, cfg, policy, loop, tokens_B, positions_B, cache,
                                           index, hidden=fused)
        return _pick(params, cfg, policy, out, key), cache, exits

    params, cache = _sampler_state(cfg, policy, shp)
    b = shp.rows
    return jax.jit(run, donate_argnums=(3,)), (params, _s((b,), jnp.int32), _s((b,), jnp.int32),
                                               cache, _s((), jnp.int32), jax.random.key(0))


def _verify(cfg: ModelConfig, policy: Policy, shp: ProgramShapes):
    from jaxrl_lp.rollout.rows import rowwise_forward
    from jaxrl_lp.rollout.sampling import first_argmax
    from jaxrl_lp.rollout.speculative import chunk_logprobs
    from jaxrl_lp.rollout.step import fused_readout, step_logits

    loop, fused = _loop(cfg), fused_readout(policy)

    def run(params, chunk_BxT, positions_BxT, cache, slot_B):
        out, cache, exits = rowwise_forward(params, cfg, policy, chunk_BxT, positions_BxT, cache,
                                            slot_B, loop=loop, hidden=fused)
        logits = step_logits(params, cfg, policy, out)
        lps = chunk_logprobs(params, cfg, policy, out, chunk_BxT, 1.0, logits)
        return first_argmax(logits, axis=-1), lps, cache, exits

    params, cache = _sampler_state(cfg, policy, shp)
    b, t = shp.rows, shp.drafts + 1
    return jax.jit(run, donate_argnums=(3,)), (params, _s((b, t), jnp.int32),
                                               _s((b, t), jnp.int32), cache, _s((b,), jnp.int32))


def _exporter_of(policy: Policy):
    from jaxrl_lp.sync.export import cast, quantize

    fmt = policy.matmul_format
    if fmt is None:
        return cast("bf16", "stochastic") if policy.is_low_precision else cast("f32")
    return quantize(fmt, kernels=policy.kernels)


def _export(cfg: ModelConfig, policy: Policy, shp: ProgramShapes):
    exporter = _exporter_of(policy)
    params = _params(cfg)
    state = jax.eval_shape(exporter.init, params)
    return jax.jit(exporter.apply), (params, _abstract(state))


def _sync_checks(cfg: ModelConfig, policy: Policy, shp: ProgramShapes):
    from jaxrl_lp.sync.checks import _requantize
    from jaxrl_lp.sync.export import served_params_for_forward
    from jaxrl_lp.sync.layout import flatten_served, is_qarray
    from jaxrl_lp.sync.probe import _probe

    exporter = _exporter_of(policy)
    params = _params(cfg)
    served = jax.eval_shape(lambda p: exporter.apply(p, exporter.init(p))[0], params)

    def run(served, tokens_BxT):
        qs = {k: q for k, q in flatten_served(served).items() if is_qarray(q)}
        requantized = _requantize(qs) if qs else {}
        lp = _probe(served_params_for_forward(served), tokens_BxT, cfg=cfg, policy=policy)
        return requantized, lp

    return jax.jit(run), (served, _s((shp.rows, 64), jnp.int32))


_BUILDERS: dict[str, Callable] = {
    "grpo_step_dense": _grpo("dense"),
    "grpo_step_hybrid": _grpo("hybrid"),
    "sft_step": _sft,
    "behaviour_logprobs": _learner_logprobs("hybrid"),
    "sampler_prefill": _prefill,
    "sampler_decode": _decode,
    "replay": _learner_logprobs("replay"),
    "speculative_verify": _verify,
    "exporter": _export,
    "sync_checks": _sync_checks,
}


def build_program(name: str, cfg: ModelConfig, policy: Policy,
                  shapes: ProgramShapes | None = None, *, remat: Remat = Remat.NONE):
    """`(jitted, abstract args)` of program `name` (module table) for `cfg` under
    `native(policy)`; a learner update's layers recompute as `remat` says
    (`models.remat`).

    Raises:
      ValueError: an unknown program (the message lists them), or `remat` for a
        program with no backward.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown program {name!r}; choose from {list(PROGRAMS)}")
    policy = native(require(policy, "build_program"))
    if name in UPDATES:
        return _BUILDERS[name](cfg, policy, shapes or ProgramShapes(), remat=Remat.of(remat))
    if Remat.of(remat) is not Remat.NONE:
        raise ValueError(f"build_program: {name} has no backward to recompute in; remat applies "
                         f"to {list(UPDATES)}")
    return _BUILDERS[name](cfg, policy, shapes or ProgramShapes())
