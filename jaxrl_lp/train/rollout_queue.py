"""Off-policy GRPO: the rollouts in flight, sampled up to `grpo.max_staleness` versions behind.

With `grpo.max_staleness = K` the rollout GRPO step n learns from is sampled
on the weights exported at step max(0, n - K): step n's export samples step
n + K's rollout, which can run on the sampler's devices while the learner
updates on step n's. The schedule is fixed by the step numbers, never by
timing, so a run gives the same numbers whether the two overlap (their own
devices, `run.sampler_mesh` / `run.learner_mesh`) or alternate (one device),
and K = 0 is the synchronous loop.

`RolloutQueue` holds the rollouts dispatched and not yet learned from
(`Pending`: the step that will learn from it, the weights version it is
sampled on, its prompts) and the sampler's copies of those weights. A
checkpoint stores the pending steps, versions and prompt indices (metadata)
and the weights (`RolloutQueue.tree`); a resumed run dispatches the same
rollouts again from the same weights with the same keys (`restore`), which
the sampler computes bit for bit as before, so a kill during an overlapped
step loses nothing and counts nothing twice.

`SamplerSide` is where the sampler runs: the learner's own devices, one other
device, or a mesh of its own; it moves the exported weights there and the
rollouts back to the learner.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl_lp.parallel.rules import param_shardings
from jaxrl_lp.parallel.shard import batch_shardings, put_tree
from jaxrl_lp.rollout.generate import concat_rollouts, generate
from jaxrl_lp.rollout.request import pad_prompts

__all__ = ["Held", "Pending", "RolloutQueue", "SamplerSide", "weights_key"]


class Held(NamedTuple):
    """The sampler's copies of one set of weights: one, or one per replica (same bits)."""

    copies: tuple                    # model params trees, on the sampler's devices


@dataclasses.dataclass(frozen=True)
class SamplerSide:
    """Where the sampler runs, relative to the learner.

    A sampler mesh with a data axis alone (`data=R`: every device holds the
    whole model, rows split) runs as R independent replicas, one
    single-device sampler program per device (`replicas`), each on a copy of
    the weights: XLA:CPU runs the multi-device programs of one process one
    after another, but single-device programs side by side, so only replicas
    overlap the learner there (on GPU and TPU they overlap either way).
    Replica r samples its contiguous share of the prompts with the key folded
    with r, at the batch's prompt width, so the rollout is the same whether
    the replicas run at once or in turn.

    Attributes:
      mesh: the sampler's own mesh (not data-only), or None.
      device: the sampler's one device, or None.
      replicas: the devices of a data-only sampler mesh, one replica each, or ().
      learner_mesh: the learner's mesh, or None (one device).
      learner_device: the learner's one device when it has no mesh, or None (the default).
      model: the model config (the parameter shardings).
      separate: the sampler has devices of its own; False: it shares the learner's.
    """

    mesh: Mesh | None = None
    device: Any = None
    replicas: tuple = ()
    learner_mesh: Mesh | None = None
    learner_device: Any = None
    model: Any = None
    separate: bool = False

    @property
    def sampler_mesh(self) -> Mesh | None:
        """The mesh the sampler's program takes: its own, or the learner's when shared."""
        return self.mesh if self.separate else self.learner_mesh

    def hold(self, params: Any, copy: bool) -> Held:
        """The sampler's copies of `params` on its devices (`copy`: also on shared devices,
        where `params` may be the master the learner step donates)."""
        if not self.separate:
            return Held((jax.tree.map(jnp.copy, params) if copy else params,))
        if self.replicas:
            return Held(tuple(jax.device_put(params, d) for d in self.replicas))
        if self.mesh is not None:
            return Held((put_tree(params, param_shardings(params, self.model, self.mesh)),))
        return Held((jax.device_put(params, self.device),))

    def generate(self, held: Held, prompts: list, *, key, **kwargs) -> Any:
        """`generate(..., **kwargs)` of `prompts` where the sampler runs, dispatched (not
        waited for): a `Rollout`, or a tuple of the replicas' (`to_learner` joins them)."""
        if not self.replicas:
            with jax.default_device(self.device) if self.device is not None \
                    else contextlib.nullcontext():
                return generate(held.copies[0], self.model, prompts, key=key,
                                mesh=self.sampler_mesh, **kwargs)
        r = len(self.replicas)
        if len(prompts) % r:
            raise ValueError(f"{len(prompts)} prompts do not split over {r} sampler replicas")
        width = pad_prompts(prompts, kwargs["pad_id"],
                            max_len=self.model.max_position_embeddings
                            - kwargs["max_new_tokens"])[0].shape[1]
        n = len(prompts) // r
        out = []
        for i, (dev, w) in enumerate(zip(self.replicas, held.copies, strict=True)):
            with jax.default_device(dev):
                out.append(generate(w, self.model, prompts[i * n:(i + 1) * n],
                                    key=jax.random.fold_in(key, i), prompt_width=width,
                                    **kwargs))
        return tuple(out)

    def params_to_learner(self, held: Held) -> Any:
        """The sampler's weights on the learner's devices (sharded like the learner's params)."""
        params = held.copies[0]
        if not self.separate:
            return params
        if self.learner_mesh is not None:
            return put_tree(params, param_shardings(params, self.model, self.learner_mesh))
        return jax.device_put(params, self.learner_device or jax.devices()[0])

    def to_learner(self, ro: Any) -> Any:
        """A rollout (a replicas' tuple: their rows in order) on the learner's devices."""
        if isinstance(ro, tuple):
            ro = concat_rollouts([jax.device_get(r) for r in ro], pad_id=0)
        if not self.separate:
            return ro
        if self.learner_mesh is not None:
            return put_tree(ro, batch_shardings(ro, self.learner_mesh))
        return jax.device_put(ro, self.learner_device or jax.devices()[0])


class Pending(NamedTuple):
    """A rollout dispatched for a later step."""

    step: int                        # the global step that learns from it
    version: int                     # the global step whose export it is sampled on
    problems: tuple[int, ...]        # its prompts (indices into the task's train split)
    rollout: Any                     # the `Rollout` on the sampler's devices, maybe running (a
                                     # tuple of them from replicas: `SamplerSide.to_learner`)
    spec_metrics: dict               # speculative sampling's statistics, or {}


def weights_key(version: int) -> str:
    """The checkpoint key of the sampler's weights of `version`."""
    return f"v{version}"


class RolloutQueue:
    """The rollouts in flight and the sampler's weights they are sampled on.

    Args:
      staleness: `grpo.max_staleness` (K >= 1; K = 0 needs no queue).
      dispatch: `dispatch(step, version, weights, problems) -> (rollout, spec_metrics)`:
        sample `problems` for `step` on `weights` (exported at step `version`) without
        waiting for it.
      draw: `draw() -> problems`, the next prompt indices of the run's stream.
      end: the run's last global step + 1: no rollout is dispatched for a step at or past it.
    """

    def __init__(self, staleness: int, dispatch: Callable, draw: Callable[[], list[int]],
                 end: int | None = None):
        if staleness < 1:
            raise ValueError(f"RolloutQueue: staleness must be >= 1, got {staleness}")
        self.staleness = staleness
        self._dispatch = dispatch
        self._draw = draw
        self.end = end
        self.pending: dict[int, Pending] = {}
        self.held: dict[int, Any] = {}   # version -> the sampler's weights

    def fill(self, step: int, weights: Any) -> None:
        """Dispatches every rollout steps `step`..`step + K` still lack, on `weights` (version `step`).

        At the first GRPO step all K + 1 are dispatched on its export; after
        that, only step + K's.
        """
        last = step + self.staleness if self.end is None else min(step + self.staleness,
                                                                  self.end - 1)
        missing = [s for s in range(step, last + 1) if s not in self.pending]
        if not missing:
            return
        self.held[step] = weights
        for s in missing:  # in step order: the prompt stream is drawn in the same order
            problems = tuple(int(i) for i in self._draw())
            ro, spec = self._dispatch(s, step, weights, problems)
            self.pending[s] = Pending(s, step, problems, ro, spec)

    def pop(self, step: int) -> tuple[Pending, Any]:
        """Step `step`'s pending rollout and the weights it was sampled on; the weights no
        later rollout needs are released."""
        if step not in self.pending:
            raise RuntimeError(f"RolloutQueue: no rollout dispatched for step {step} "
                               f"(pending: {sorted(self.pending)})")
        entry = self.pending.pop(step)
        weights = self.held[entry.version]
        needed = {p.version for p in self.pending.values()}
        self.held = {v: w for v, w in self.held.items() if v in needed}
        return entry, weights

    def meta(self) -> list[dict]:
        """The pending rollouts, for a checkpoint's metadata (JSON)."""
        return [{"step": p.step, "version": p.version, "problems": list(p.problems)}
                for p in sorted(self.pending.values(), key=lambda p: p.step)]

    def tree(self) -> dict:
        """The sampler's weights the pending rollouts need, keyed by `weights_key`."""
        needed = sorted({p.version for p in self.pending.values()})
        return {weights_key(v): self.held[v].copies[0] for v in needed}

    def restore(self, meta: list[dict], tree: dict, hold: Callable[[Any], Held]) -> None:
        """Dispatches a checkpoint's pending rollouts again on its saved weights.

        The same step (so the same sampling key), the same prompts and the same
        weights (`hold` places the restored tree as the sampler holds it): the
        sampler computes the same rollouts bit for bit.
        """
        self.pending, self.held = {}, {}
        for item in meta:
            v = int(item["version"])
            if v not in self.held:
                self.held[v] = hold(tree[weights_key(v)])
            weights = self.held[v]
            problems = tuple(int(i) for i in item["problems"])
            ro, spec = self._dispatch(int(item["step"]), v, weights, problems)
            self.pending[int(item["step"])] = Pending(int(item["step"]), v, problems, ro, spec)
