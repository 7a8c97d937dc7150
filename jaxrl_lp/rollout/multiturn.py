"""The multi-turn sampler: model turns and environment observations on one KV cache, replayed
bit for bit.

An episode alternates model turns and observations. A model turn is decoded until a
stop condition (EOS, one of `stop_token_ids`, or `max_turn_tokens`); the turns of all
rows are handed to their environments (the caller's `step` function, typically an
`envs.EnvRunner`); each observation is prefilled on the cache the sampler holds, after the
turn's last token (which no decode step fed), and the next turn is decoded from its last
slot. No context is prefilled twice.

The batch runs in lockstep over cache slots: a turn's decode segment writes one slot per
step for every row, and a row whose turn ended waits, its slots marked empty (position
-1, never attended to); an observation chunk is left-padded to a bucketed width. A
row's tokens still sit at positions 0..n-1 whatever the holes, so its values depend on
its own inputs alone.

Exactness by construction, as the single-turn sampler's (`rollout.generate`): two
jitted programs (`rollout.multiturn_programs`), the chunk prefill and the decode
segment, each takes the tokens to
force and a flag, so the replay (`replay_multiturn`) runs the very executables the
sampler ran, on the same inputs, in the same order: the segments' step counts, the
chunk widths and the observations come from the record (`MultiTurnRecord`); no
environment is called. Under matched policies and the sampler's weights its
log-probs are the sampler's bits.

The rollout it returns is a `Rollout` whose completion holds each row's turns and
observations in order, compacted (no holes): `completion_mask` is 1 on the policy's
tokens only (the loss), `env_mask` 1 on the observations, `logprobs` and `exit_steps`
the sampler's (observations: 0 and, for a looped model, its last loop step, the depth
they ran at). The learner's dense log-probs read it as any rollout; its replay is
`replay_multiturn`, which `rollout.replay` refuses to stand in for.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.models.blocks import unstack_layers
from jaxrl_lp.models.cache import init_cache, unstack_cache
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.numerics.fingerprint import tree_fingerprint
from jaxrl_lp.numerics.policy import FP32, Policy, require
from jaxrl_lp.rollout.multiturn_programs import (
    ENDED_BY,
    chunk_program,
    segment_program,
)
from jaxrl_lp.rollout.request import bucket_length
from jaxrl_lp.rollout.rollout import Rollout
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.rollout.step import LoopSpec, decode_layout

__all__ = ["ENDED_BY", "MultiTurnRecord", "MultiTurnRollout", "TurnLimits", "TurnOutcome",
           "generate_multiturn", "replay_multiturn"]



@dataclasses.dataclass(frozen=True)
class TurnLimits:
    """The shape of an episode.

    Attributes:
      max_turns: model turns per episode at most (>= 1).
      max_turn_tokens: tokens of one model turn at most (>= 1); a turn that reaches it
        without a stop ends as `length`.
      max_observation_tokens: tokens of one observation at most; a longer one ends the
        episode (reason `observation_overflow`).
      stop_token_ids: tokens that end a model turn (besides EOS), e.g. a tool call's end.
      eos_id: the end-of-sequence token (None: only stop tokens and the limit end a turn).
      pad_id: the token of empty slots.
    """

    max_turns: int
    max_turn_tokens: int
    max_observation_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    eos_id: int | None = None
    pad_id: int = 0

    def __post_init__(self):
        for name, low in (("max_turns", 1), ("max_turn_tokens", 1), ("max_observation_tokens", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"TurnLimits.{name}={v!r}: an int >= {low}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def chunk_width(self) -> int:
        """Slots of the widest observation chunk (the turn's last token, then the observation)."""
        return bucket_length(1 + self.max_observation_tokens)

    def cache_slots(self, prompt_width: int) -> int:
        """Cache slots an episode may use: the prompt, every turn's decode steps and the
        observation chunks between turns."""
        return (prompt_width + self.max_turns * self.max_turn_tokens
                + (self.max_turns - 1) * self.chunk_width)


class TurnOutcome(NamedTuple):
    """What a row's environment answered to a turn (the `step` callback's value per row).

    observation: the observation's token ids (appended after the turn; () when done).
    reward: the turn's reward.
    done: the episode ended.
    info: per-turn facts for metrics (`tool_call`, `tool_ok`, `failed`).
    """

    observation: tuple[int, ...] = ()
    reward: float = 0.0
    done: bool = False
    info: Any = None


@dataclasses.dataclass(frozen=True)
class MultiTurnRecord:
    """What a multi-turn call ran, for its replay (host values).

    Attributes:
      prompt_BxP, positions_BxP: the left-padded prompts and their positions.
      steps: per turn, the decode steps its segment ran (the replay runs as many).
      chunks: per observation chunk, (tokens [B, W], positions [B, W]) as prefilled.
      turn_tokens: per turn, [B, T] the tokens each row sampled (pad after its end).
      turn_exits: per turn, [B, T] the exit step of the forward that produced each
        (a looped model's; 0 for a dense one).
      turn_index: per turn, [B, T] where each sampled token sits in the compacted
        completion (-1: none), for scattering the replay's log-probs.
      active: per turn, [B] bool the rows that took the turn.
      key: the sampling key of the call.
      sampling: the `SamplingConfig` it sampled with (static in its programs: the replay
        runs the same executables).
      cache_slots: the cache length the call ran with.
      layout: the decode layout of the weights (`rollout.step.decode_layout`).
    """

    prompt_BxP: np.ndarray
    positions_BxP: np.ndarray
    steps: tuple[int, ...]
    chunks: tuple[tuple[np.ndarray, np.ndarray], ...]
    turn_tokens: tuple[np.ndarray, ...]
    turn_exits: tuple[np.ndarray, ...]
    turn_index: tuple[np.ndarray, ...]
    active: tuple[np.ndarray, ...]
    key: Any
    sampling: SamplingConfig
    cache_slots: int
    layout: str


@dataclasses.dataclass(frozen=True)
class MultiTurnRollout:
    """A multi-turn rollout: the learner's `Rollout` and what its replay needs.

    Attributes:
      rollout: the compacted rollout (module docstring), `env_mask` set.
      record: the call's `MultiTurnRecord`.
      limits: the `TurnLimits` it ran with.
      rewards: [B] f32 each episode's reward (the sum of its turns').
      turn_rewards: [B, T] f32 the reward of each model turn (T = `limits.max_turns`;
        0 after the episode's last turn; an `observation_overflow` episode's all 0).
      turns: [B] int32 model turns each episode took.
      reasons: per row, why its episode ended: `done` (its environment said so),
        `max_turns`, `context`, `observation_overflow`, or the `failed` reason of its
        outcome's info (an `envs.EnvRunner`'s: `error: ...`, `timeout`).
      infos: per row, the list of its turns' `info` values.
      prefill_tokens: real tokens prefilled, prompts and chunks (observations and the
        turns' last tokens); the decode steps are counted apart (`decode_steps`).
      decode_steps: decode steps of all segments (each advances every row one slot).
      env_seconds: wall seconds spent in `step`.
    """

    rollout: Rollout
    record: MultiTurnRecord
    limits: TurnLimits
    rewards: np.ndarray
    turn_rewards: np.ndarray
    turns: np.ndarray
    reasons: tuple[str, ...]
    infos: tuple[tuple[Any, ...], ...]
    prefill_tokens: int
    decode_steps: int
    env_seconds: float

    def token_turns(self) -> np.ndarray:
        """[B, N] int32 the model turn each policy token belongs to (-1 on observations and
        padding), in the rollout's compact layout."""
        out = np.full(self.rollout.completion_tokens.shape, -1, np.int32)
        for turn, idx in enumerate(self.record.turn_index):
            rows, cols = np.nonzero(idx >= 0)
            out[rows, idx[rows, cols]] = turn
        return out


# ----------------------------------------------------------------------------- the host loop
def _left_pad(rows: Sequence[Sequence[int]], starts: np.ndarray, width: int, pad_id: int):
    """(tokens [B, W], positions [B, W]) of chunks left-padded to `width`; row b's tokens at
    positions starts[b], starts[b] + 1, ...; empty rows all padding (position -1)."""
    b = len(rows)
    tokens = np.full((b, width), pad_id, np.int32)
    positions = np.full((b, width), -1, np.int32)
    for r, ids in enumerate(rows):
        if ids:
            n = len(ids)
            tokens[r, width - n:] = ids
            positions[r, width - n:] = starts[r] + np.arange(n)
    return tokens, positions


def _run(params, cfg: ModelConfig, policy: Policy, loop: LoopSpec, sampling: SamplingConfig,
         limits: TurnLimits, prompt_BxP: np.ndarray, positions_BxP: np.ndarray, key,
         step: Callable | None, record: MultiTurnRecord | None):
    """The host loop of `generate_multiturn` (`record` None, `step` given) and of
    `replay_multiturn` (`record` given: everything forced, no environment)."""
    b, p = prompt_BxP.shape
    t = limits.max_turn_tokens
    slots = limits.cache_slots(p) if record is None else record.cache_slots
    replay = record is not None
    # The decode copy of the weights as `generate` lays it out (`rollout.step.decode_layout`);
    # the replay lays them out as the sampler did.
    layout = decode_layout(params, policy) if record is None else record.layout
    weights = unstack_layers(params, transpose=layout == "transposed", policy=policy)
    cache = unstack_cache(init_cache(cfg, policy, b, slots), cfg)
    statics = dict(cfg=cfg, policy=policy, loop=loop)
    seg_statics = dict(sampling=sampling, turn_tokens=t, stop_ids=limits.stop_token_ids,
                       eos_id=limits.eos_id, pad_id=limits.pad_id, **statics)
    on = jnp.asarray(replay)
    zeros_b = jnp.zeros((b,), jnp.int32)
    readout = lambda k: (jnp.asarray(record.turn_exits[k][:, 0])
                         if replay and k < len(record.turn_exits) else zeros_b)
    out, cache, exit0, _ = chunk_program(weights, cache, jnp.asarray(prompt_BxP),
                                          jnp.asarray(positions_BxP), jnp.int32(0), readout(0),
                                          on, **statics)
    lengths = (positions_BxP >= 0).sum(axis=1).astype(np.int32)
    next_pos = lengths.copy()  # position of each row's next token
    slot = p
    active = np.ones(b, bool)
    turns_lp, turns_tok, turns_exit, turns_len = [], [], [], []
    steps, chunks, actives = [], [], []
    rewards, n_turns = np.zeros(b, np.float32), np.zeros(b, np.int32)
    turn_rewards = np.zeros((b, limits.max_turns), np.float32)
    reasons: list[str | None] = [None] * b
    infos: list[list[Any]] = [[] for _ in range(b)]
    observations: list[list[tuple[int, ...]]] = [[] for _ in range(b)]
    env_seconds, prefill_tokens, decode_steps = 0.0, int(lengths.sum()), 0
    for turn in range(limits.max_turns if not replay else len(record.steps)):
        if replay:
            active = record.active[turn]
            forced = jnp.asarray(record.turn_tokens[turn])
            forced_exits = jnp.asarray(record.turn_exits[turn])
            limit = record.steps[turn] + 1
        else:
            forced = forced_exits = jnp.zeros((b, t), jnp.int32)
            limit = t
        key, sub = jax.random.split(key)
        seg = segment_program(weights, cache, out, exit0, jnp.int32(slot),
                               jnp.asarray(next_pos), jnp.asarray(active), sub,
                               jnp.int32(limit), forced, forced_exits, on, **seg_statics)
        ran = int(seg.i) - 1  # decode steps: slots [slot, slot + ran)
        cache, slot, decode_steps = seg.cache, slot + ran, decode_steps + ran
        length, ended = np.asarray(seg.length), np.asarray(seg.ended)
        tokens = np.asarray(seg.tokens)
        turns_lp.append(seg.logprobs)
        turns_exit.append(seg.exits)
        turns_tok.append(tokens)
        turns_len.append(np.where(active, length, 0))
        steps.append(ran)
        actives.append(active.copy())
        n_turns += active
        if replay:
            if turn < len(record.chunks):
                ctoks, cpos = record.chunks[turn]
            else:
                break
        else:
            feed: list[tuple[int, ...]] = [()] * b
            outcomes = [None] * b
            todo = [r for r in range(b) if active[r]]
            asked = todo  # every ended turn, the limit's too: its environment decides
            if asked:
                t0 = time.perf_counter()
                answers = step(asked,
                               [tuple(int(x) for x in tokens[r, :length[r]]) for r in asked],
                               [ENDED_BY[ended[r]] for r in asked])
                env_seconds += time.perf_counter() - t0
                for r, a in zip(asked, answers, strict=True):
                    outcomes[r] = a
            for r in todo:
                a = outcomes[r]
                if a is None:
                    continue
                rewards[r] += a.reward
                turn_rewards[r, turn] = a.reward
                infos[r].append(a.info)
                failed = isinstance(a.info, dict) and a.info.get("failed")
                if a.done:
                    reasons[r] = failed or "done"
                elif len(a.observation) > limits.max_observation_tokens:
                    reasons[r] = "observation_overflow"
                    rewards[r] = 0.0
                    turn_rewards[r] = 0.0
                elif turn + 1 == limits.max_turns:
                    reasons[r] = "max_turns"
                else:
                    obs = tuple(int(x) for x in a.observation)
                    feed[r] = (int(tokens[r, length[r] - 1]), *obs)
                    observations[r].append(obs)
            for r in todo:
                if reasons[r] is None and not feed[r]:
                    reasons[r] = "max_turns" if turn + 1 == limits.max_turns else "done"
            active = np.array([bool(feed[r]) for r in range(b)])
            if not active.any():
                break
            width = limits.chunk_width
            if slot + width + t > slots:  # cannot happen within `cache_slots`; kept explicit
                for r in range(b):
                    if active[r]:
                        reasons[r] = "context"
                break
            ctoks, cpos = _left_pad(feed, next_pos + length - 1, width, limits.pad_id)
            chunks.append((ctoks, cpos))
        prefill_tokens += int((cpos >= 0).sum())
        out, cache, exit0, _ = chunk_program(weights, cache, jnp.asarray(ctoks),
                                              jnp.asarray(cpos), jnp.int32(slot),
                                              readout(turn + 1), on, **statics)
        slot += ctoks.shape[1]
        next_pos = np.where((cpos >= 0).any(axis=1), cpos.max(axis=1) + 1, next_pos)
    for r in range(b):
        if reasons[r] is None:
            reasons[r] = "max_turns"
    return dict(layout=layout, turns_lp=turns_lp, turns_tok=turns_tok, turns_exit=turns_exit,
                turns_len=turns_len, steps=steps, chunks=chunks,
                actives=actives, rewards=rewards, turn_rewards=turn_rewards,
                n_turns=n_turns, reasons=reasons,
                infos=infos, observations=observations, env_seconds=env_seconds,
                prefill_tokens=prefill_tokens, decode_steps=decode_steps, slots=slots)


def _compact(run: dict, b: int, n_loop: int, pad_id: int):
    """Each row's turns and observations in order, without holes: tokens, policy mask, env
    mask, the sampler's exit steps, and per turn the compact index of every sampled token."""
    seqs = [[] for _ in range(b)]  # (token, from_policy, exit)
    index = []
    for k, (tok, ln) in enumerate(zip(run["turns_tok"], run["turns_len"], strict=True)):
        exits = np.asarray(run["turns_exit"][k])
        idx = np.full(tok.shape, -1, np.int32)
        for r in range(b):
            for i in range(int(ln[r])):
                idx[r, i] = len(seqs[r])
                seqs[r].append((int(tok[r, i]), True, int(exits[r, i])))
            # A row takes turns 0, 1, ... until its episode ends: turn k's observation is its k-th.
            if ln[r] and k < len(run["observations"][r]):
                for o in run["observations"][r][k]:
                    seqs[r].append((o, False, n_loop - 1))
        index.append(idx)
    n = bucket_length(max(max((len(s) for s in seqs), default=1), 1))
    tokens = np.full((b, n), pad_id, np.int32)
    policy_mask = np.zeros((b, n), np.float32)
    env_mask = np.zeros((b, n), np.float32)
    exit_steps = np.zeros((b, n), np.int32)
    for r, s in enumerate(seqs):
        for j, (tok, pol, ex) in enumerate(s):
            tokens[r, j], exit_steps[r, j] = tok, ex
            (policy_mask if pol else env_mask)[r, j] = 1.0
    return tokens, policy_mask, env_mask, exit_steps, index


def _scatter(turn_values: Sequence[Any], index: Sequence[np.ndarray], shape) -> np.ndarray:
    """The per-turn values [B, T] placed at their compact positions (zeros elsewhere)."""
    out = np.zeros(shape, np.float32)
    for vals, idx in zip(turn_values, index, strict=True):
        vals = np.asarray(vals)
        rows, cols = np.nonzero(idx >= 0)
        out[rows, idx[rows, cols]] = vals[rows, cols]
    return out


def generate_multiturn(
    params: dict,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    step: Callable[[list[int], list[tuple[int, ...]], list[str]], Sequence[TurnOutcome]],
    limits: TurnLimits,
    *,
    policy: Policy = FP32,
    sampling: SamplingConfig = SamplingConfig(greedy=True),
    loop: LoopSpec = LoopSpec(),
    key: jax.Array | None = None,
    weights_version: int = 0,
) -> MultiTurnRollout:
    """Samples one episode per prompt: model turns, environment observations, on one cache.

    Args:
      params, cfg: the model.
      prompts: ragged token ids, one episode each (repeat a prompt for a group).
      step: the environments: `step(rows, turns, ended_by)` gets the rows whose turn
        ended this round, each turn's token ids as sampled (the last one the stop
        token or EOS that ended it) and how each ended (`eos`, `stop` or `length`,
        the per-turn limit), and returns one `TurnOutcome` per row, in order.
      limits: the episode's `TurnLimits`.
      policy, sampling, loop, key, weights_version: as `rollout.generate`.

    Returns:
      A `MultiTurnRollout` (module docstring).

    Raises:
      ValueError: empty prompts, or a cache longer than the model's context.
    """
    policy = require(policy, "generate_multiturn")
    loop = LoopSpec.parse(loop).resolve(cfg)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate_multiturn: every prompt needs at least one token")
    if key is None:
        if not sampling.greedy:
            raise ValueError("generate_multiturn: sampling (greedy=False) needs a key")
        key = jax.random.PRNGKey(0)
    width = bucket_length(max(len(p) for p in prompts))
    if limits.cache_slots(width) > cfg.max_position_embeddings:
        raise ValueError(
            f"generate_multiturn: an episode may use {limits.cache_slots(width)} cache slots "
            f"(prompt {width}, {limits.max_turns} turns of {limits.max_turn_tokens} tokens, "
            f"observation chunks of {limits.chunk_width}) but the model's context is "
            f"{cfg.max_position_embeddings}; lower the turn limits")
    b = len(prompts)
    prompt = np.full((b, width), limits.pad_id, np.int32)
    positions = np.full((b, width), -1, np.int32)
    for r, ids in enumerate(prompts):
        prompt[r, width - len(ids):] = ids
        positions[r, width - len(ids):] = np.arange(len(ids))
    run = _run(params, cfg, policy, loop, sampling, limits, prompt, positions, key, step, None)
    n_loop = cfg.loop_steps if cfg.is_looped else 1
    tokens, policy_mask, env_mask, exit_steps, index = _compact(run, b, n_loop, limits.pad_id)
    logprobs = _scatter(run["turns_lp"], index, tokens.shape)
    record = MultiTurnRecord(
        prompt_BxP=prompt, positions_BxP=positions, steps=tuple(run["steps"]),
        chunks=tuple(run["chunks"]), turn_tokens=tuple(run["turns_tok"]),
        turn_exits=tuple(np.asarray(e) for e in run["turns_exit"]),
        turn_index=tuple(index), active=tuple(run["actives"]), key=key, sampling=sampling,
        cache_slots=run["slots"], layout=run["layout"])
    ro = Rollout(
        prompt_tokens=jnp.asarray(prompt), prompt_lengths=jnp.asarray((positions >= 0).sum(1),
                                                                       jnp.int32),
        completion_tokens=jnp.asarray(tokens), completion_mask=jnp.asarray(policy_mask),
        logprobs=jnp.asarray(logprobs), exit_steps=jnp.asarray(exit_steps),
        loop_evals=jnp.int32(0), weights_version=jnp.int32(weights_version), policy=policy,
        loop=loop, temperature=sampling.temperature, weights_digest=tree_fingerprint(params),
        env_mask=jnp.asarray(env_mask))
    return MultiTurnRollout(
        rollout=ro, record=record, limits=limits, rewards=run["rewards"],
        turn_rewards=run["turn_rewards"], turns=run["n_turns"].astype(np.int32),
        reasons=tuple(run["reasons"]),
        infos=tuple(tuple(i) for i in run["infos"]), prefill_tokens=run["prefill_tokens"],
        decode_steps=run["decode_steps"], env_seconds=run["env_seconds"])


def replay_multiturn(params: dict, cfg: ModelConfig, policy: Policy,
                     mt: MultiTurnRollout) -> jax.Array:
    """The log-probs [B, N] of a multi-turn rollout's policy tokens, by its sampler's programs.

    Runs the chunk and segment programs the sampler ran, in its order, on its inputs,
    with every token (and a looped model's read-out and exit steps) forced and no
    environment called (module docstring): under the sampler's weights and policy the
    values are its bits. Observations and padding are 0. A host-level call; the whole
    call's rows are replayed.

    Raises:
      ValueError: `policy` or the model differs from the rollout's in what the replay
        reads (its policy's storage, the loop spec).
    """
    policy = require(policy, "replay_multiturn")
    ro, rec = mt.rollout, mt.record
    loop = LoopSpec.parse(ro.loop).resolve(cfg)
    if loop != ro.loop:
        raise ValueError(f"replay_multiturn: the rollout ran loop spec {ro.loop}; this model "
                         f"reads {loop}")
    run = _run(params, cfg, policy, loop, rec.sampling, mt.limits, rec.prompt_BxP,
               rec.positions_BxP, rec.key, None, rec)
    return jnp.asarray(_scatter(run["turns_lp"], rec.turn_index, ro.completion_tokens.shape))
