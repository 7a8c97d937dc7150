"""The sampler: prefill, then a jitted `lax.while_loop` decode over a preallocated KV cache.

Prompts are left-padded to a bucketed length P (so new prompt lengths reuse
compiled programs); pad slots hold position -1 and are never attended to. A
sequence's tokens sit at positions 0..n-1 whatever its padding, so a prompt
gives the same result alone or in a ragged batch. Generated token j of a
sequence sits at cache slot P + j - 1 when it is fed back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.models.blocks import unstack_layers
from jaxrl_lp.models.cache import init_cache, unstack_cache
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rollout.sampling import SamplingConfig, sample_tokens
from jaxrl_lp.rollout.step import LoopSpec, decode_step, prefill

__all__ = ["Rollout", "bucket_length", "generate", "pad_prompts"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rollout:
    """A batch of sampled completions, everything the learner needs to replay them.

    Attributes:
      prompt_tokens: [B, P] int32, left-padded with `pad_id`.
      prompt_lengths: [B] int32, real prompt lengths.
      completion_tokens: [B, N] int32; `pad_id` after a sequence has ended.
      completion_mask: [B, N] f32, 1 for generated tokens (up to and including EOS).
      logprobs: [B, N] f32 sampler log-probs of the sampled tokens, after temperature.
      exit_steps: [B, N] int32 0-based loop step at which the forward that
        produced completion token j read out (and, in deferred mode, where its
        input token stopped computing); 0 for dense models.
      loop_evals: [] int32 loop-step evaluations of the decode steps (counted).
      weights_version: [] int32 learner step whose weights sampled this.
      policy: the sampler's precision policy string (static).
      loop: the looped-model `LoopSpec` as `exit_rule/compute_mode` (static).
      temperature: the temperature the log-probs were taken at (static).
    """

    prompt_tokens: jax.Array
    prompt_lengths: jax.Array
    completion_tokens: jax.Array
    completion_mask: jax.Array
    logprobs: jax.Array
    exit_steps: jax.Array
    loop_evals: jax.Array
    weights_version: jax.Array
    policy: str = dataclasses.field(default="fp32", metadata={"static": True})
    loop: str = dataclasses.field(default="full/dense", metadata={"static": True})
    temperature: float = dataclasses.field(default=1.0, metadata={"static": True})


def bucket_length(n: int, minimum: int = 8) -> int:
    """The padded length for n prompt tokens: the next power of two, at least `minimum`."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, bucket: bool = True,
                max_len: int | None = None):
    """Left-pads ragged prompts; returns (tokens [B, P], positions [B, P], lengths [B]) numpy.

    With `bucket`, P is the longest prompt's `bucket_length`, capped at `max_len`
    (but never below the longest prompt).
    """
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if (lengths == 0).any():
        raise ValueError(f"empty prompt at index {int(np.argmin(lengths))}: every prompt needs "
                         "at least one token (e.g. a BOS token)")
    p = int(lengths.max())
    if bucket:
        cap = bucket_length(p) if max_len is None else min(bucket_length(p), max_len)
        p = max(p, cap)
    toks = np.full((len(prompts), p), pad_id, np.int32)
    pos = np.full((len(prompts), p), -1, np.int32)
    for i, pr in enumerate(prompts):
        toks[i, p - len(pr):] = pr
        pos[i, p - len(pr):] = np.arange(len(pr))
    return toks, pos, lengths


@functools.partial(jax.jit, static_argnames=("cfg", "policy", "loop", "sampling", "max_new_tokens", "eos_id",
                          "pad_id"))
def _generate(params, prompt_BxP, positions_BxP, lengths_B, key, version, *, cfg, policy, loop,
              sampling, max_new_tokens, eos_id, pad_id):
    b, p = prompt_BxP.shape
    n = max_new_tokens
    # Sliced once, here: inside the loop a scan over stacked weights copies them every step.
    params = unstack_layers(params)
    cache = unstack_cache(init_cache(cfg, policy, b, p + n), cfg)
    logits, cache, exit0, _ = prefill(params, cfg, policy, loop, prompt_BxP, positions_BxP, cache)
    key, sub = jax.random.split(key)
    tok, lp = sample_tokens(logits, sub, sampling)
    done = jnp.zeros((b,), bool) if eos_id is None else tok == eos_id
    buf_tok = jnp.full((b, n), pad_id, jnp.int32).at[:, 0].set(tok)
    buf_lp = jnp.zeros((b, n), jnp.float32).at[:, 0].set(lp)
    buf_exit = jnp.zeros((b, n), jnp.int32).at[:, 0].set(exit0)
    buf_mask = jnp.zeros((b, n), jnp.float32).at[:, 0].set(1.0)

    def cond(s):
        i, done = s[0], s[2]
        return (i < n) & ~jnp.all(done)

    def body(s):
        i, tok, done, cache, key, evals, buf_tok, buf_lp, buf_exit, buf_mask = s
        pos = lengths_B + i - 1
        logits, cache, exits, ev = decode_step(params, cfg, policy, loop, tok, pos, cache,
                                               p + i - 1, active_B=~done)
        key, sub = jax.random.split(key)
        new, lp = sample_tokens(logits, sub, sampling)
        new = jnp.where(done, pad_id, new)
        live = (~done).astype(jnp.float32)
        buf_tok = buf_tok.at[:, i].set(new)
        buf_lp = buf_lp.at[:, i].set(lp * live)
        buf_exit = buf_exit.at[:, i].set(jnp.where(done, 0, exits))
        buf_mask = buf_mask.at[:, i].set(live)
        if eos_id is not None:
            done = done | (new == eos_id)
        return (i + 1, new, done, cache, key, evals + ev, buf_tok, buf_lp, buf_exit, buf_mask)

    state = (jnp.int32(1), tok, done, cache, key, jnp.int32(0), buf_tok, buf_lp, buf_exit,
             buf_mask)
    state = jax.lax.while_loop(cond, body, state)
    _, _, _, _, _, evals, buf_tok, buf_lp, buf_exit, buf_mask = state
    return Rollout(
        prompt_tokens=prompt_BxP, prompt_lengths=lengths_B, completion_tokens=buf_tok,
        completion_mask=buf_mask, logprobs=buf_lp, exit_steps=buf_exit, loop_evals=evals,
        weights_version=jnp.asarray(version, jnp.int32), policy=str(policy),
        loop=f"{loop.exit_rule}/{loop.compute_mode}", temperature=sampling.temperature,
    )


def generate(
    params: dict,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    *,
    policy: Policy | str = "fp32",
    sampling: SamplingConfig = SamplingConfig(greedy=True),
    max_new_tokens: int = 32,
    num_samples: int = 1,
    eos_id: int | None = None,
    pad_id: int = 0,
    loop: LoopSpec = LoopSpec(),
    key: jax.Array | None = None,
    weights_version: int = 0,
) -> Rollout:
    """Samples `num_samples` completions for each prompt (G samples per prompt, grouped).

    Rows are ordered prompt-major: row `i * num_samples + g` is sample g of prompt i.
    The decode loop stops as soon as every sequence has produced `eos_id` (or
    after `max_new_tokens`).

    The layer weights are unstacked once per call (`unstack_layers`, a
    transient copy of them): pass params already unstacked to skip it when
    sampling repeatedly from the same weights.

    Args:
      params: parameter pytree (the served copy), layers stacked or unstacked.
      cfg: model architecture.
      prompts: ragged lists of token ids.
      policy: the sampler's precision policy.
      sampling: greedy / temperature / top-k / top-p.
      max_new_tokens: tokens to generate at most (>= 1).
      num_samples: G completions per prompt.
      eos_id: the end-of-sequence id, or None.
      pad_id: filler for padding and finished sequences.
      loop: exit rule and compute mode (looped models).
      key: PRNG key for sampling (required unless greedy).
      weights_version: recorded in the rollout.

    Returns:
      A `Rollout`.

    Example:
      >>> ro = generate(params, cfg, [[1, 2, 3]], max_new_tokens=8)
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1; got {num_samples}")
    policy = Policy.parse(policy)
    # The bucket is capped so that prompt slots plus new tokens fit the context.
    toks, pos, lengths = pad_prompts(prompts, pad_id,
                                     max_len=cfg.max_position_embeddings - max_new_tokens)
    longest = int(lengths.max())
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the "
            f"model's context of {cfg.max_position_embeddings} tokens; shorten the prompt or "
            "lower max_new_tokens"
        )
    if bad := [int(t) for t in np.unique(np.concatenate([np.asarray(p) for p in prompts]))
               if not 0 <= t < cfg.vocab_size]:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, "
                         f"{cfg.vocab_size})")
    if num_samples > 1:
        toks, pos, lengths = (np.repeat(a, num_samples, axis=0) for a in (toks, pos, lengths))
    if key is None:
        if not sampling.greedy:
            raise ValueError("sampling needs a PRNG key (key=jax.random.key(seed))")
        key = jax.random.PRNGKey(0)
    return _generate(params, jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(lengths), key,
                     weights_version, cfg=cfg, policy=policy, loop=loop, sampling=sampling,
                     max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id)
