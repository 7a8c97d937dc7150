"""LoRA inside the training program: where the base comes from, when LoRA starts, checkpoints.

A run with `lora.rank > 0` trains adapters on a frozen base (`jaxrl_lp.lora`):

- **The base** is a pretrained checkpoint (`init_from`): LoRA from the first
  step, the warm-start included (`jaxrl-lp sft` is LoRA SFT); or, without
  one, the run's own full warm-start: the warm-start trains the whole model
  (a LoRA on random weights learns nothing worth keeping) and LoRA starts at
  the first GRPO step on the warm-started weights, which are written once to
  `<run>/lora_base` (orbax, f32) at that moment (`begin_lora`).
- **Checkpoints** of the LoRA phase hold the adapters and their optimizer
  state only (`params = {"adapters": ...}`), and in their metadata (`lora`)
  the adapters' settings and the base's identity: where it comes from and the
  fingerprint of the base as held (`numerics.fingerprint`, 64 bits of every
  element). A resume, `jaxrl-lp eval` and `convert` rebuild the base from
  that source and refuse one whose fingerprint differs
  (`LoraCheckpoints`, `read_lora_params`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxrl_lp.lora import (
    LoraConfig,
    LoraParams,
    LoraWeights,
    adapter_shapes,
    hold_base,
    matmul_shapes,
)
from jaxrl_lp.lora.export import merged_exporter, served_format_exporter
from jaxrl_lp.models.model import init_params
from jaxrl_lp.numerics.fingerprint import tree_fingerprint
from jaxrl_lp.numerics.qarray import get_format
from jaxrl_lp.train.checkpoint import Checkpointer
from jaxrl_lp.train.run_state import RunState

__all__ = ["LoraCheckpoints", "LoraPlan", "begin_lora", "check_rank_splits", "lora_plan",
           "read_lora_params"]

BASE_DIR = "lora_base"  # <run>/lora_base: the warm-started base of a LoRA GRPO phase
_SPEC_KEYS = ("rank", "alpha", "targets", "base_format", "serve")


class LoraPlan(NamedTuple):
    """What a LoRA run builds from its config (`lora_plan`; `RunPlan.lora`)."""

    spec: LoraConfig
    weights: LoraWeights     # the learner steps' representation
    start: int               # the global step LoRA starts at: 0 (init_from) or sft.steps
    exporter: Any            # the merged copy's exporter (`lora.serve=merged`), else None


def lora_plan(cfg, mcfg) -> LoraPlan | None:
    """The run's `LoraPlan` (None when `lora.rank` is 0), every LoRA setting checked.

    Raises ValueError naming the key and the fix: a rank above a targeted
    matrix's size, a low-bit `sft.optimizer`, a quantized base on a mesh or
    with a block size that does not divide a matmul, `sync.bf16_start`, an
    exporter without merged serving, LoRA SFT without a pretrained base.
    """
    from jaxrl_lp.train.sync_hooks import make_exporter

    spec = cfg.lora
    if not spec.enabled:
        return None
    spec.check_model(matmul_shapes(mcfg))
    opt = cfg.sft.optimizer
    if opt != "adamw":
        kind = opt.split(":")[0]
        why = ("keeps no latent weights: its codes are the weights, and there is nothing for "
               "an adapter to sit beside" if kind == "error_diffusion" else
               "trains the weights themselves as quantized latents")
        raise ValueError(f"lora.rank={spec.rank} adapts a frozen base with AdamW on the adapters, "
                         f"but sft.optimizer={opt!r} {why}; set sft.optimizer=adamw (a quantized "
                         "base is lora.base_format=nvfp4, say) or lora.rank=0")
    if cfg.run.mesh:
        check_rank_splits(spec, cfg.run.mesh, "run.mesh")
    quantized = spec.base_format not in ("f32", "bf16")
    if quantized and cfg.run.mesh:
        raise ValueError(f"lora.base_format={spec.base_format} holds the base as codes and scales, "
                         f"which have no sharding rules yet: set run.mesh='' (got "
                         f"run.mesh={cfg.run.mesh!r}) or lora.base_format=bf16")
    if quantized and (bs := get_format(spec.base_format).block_size):
        for name, (n_in, _) in matmul_shapes(mcfg).items():
            if n_in % bs:
                raise ValueError(f"lora.base_format={spec.base_format}: layers/{name} has a "
                                 f"reduction axis of {n_in}, not a multiple of the format's block "
                                 f"size {bs}; choose fp8 (per tensor) or bf16")
    if cfg.sync.bf16_start:
        raise ValueError("sync.bf16_start rounds an f32 master, and a LoRA run's base is held "
                         f"as lora.base_format={spec.base_format}; set sync.bf16_start=false "
                         "(lora.base_format=bf16 holds the base in bf16)")
    if spec.serve == "unmerged" and cfg.sync.exporter != "none":
        raise ValueError(f"lora.serve=unmerged: the sampler runs the base as held and the "
                         f"adapters as trained, so sync.exporter={cfg.sync.exporter!r} would "
                         "export nothing; set lora.serve=merged to serve W + A B rounded by it, "
                         "or sync.exporter=none")
    if not cfg.init_from and cfg.grpo.steps == 0:
        raise ValueError(f"lora.rank={spec.rank}: without init_from the base is the run's own "
                         "full warm-start and LoRA starts at the first GRPO step, which this run "
                         "(grpo.steps=0, e.g. jaxrl-lp sft) does not have; set init_from to a "
                         "pretrained checkpoint for LoRA SFT, or lora.rank=0")
    exporter = None
    if spec.serve == "merged":
        inner = (make_exporter(cfg.sync.exporter, cfg.sync.seed) if cfg.sync.exporter != "none"
                 else served_format_exporter(spec.base_format))
        exporter = merged_exporter(inner)
    start = 0 if cfg.init_from else cfg.sft.steps
    return LoraPlan(spec, LoraWeights(spec, mcfg, cfg.run.seed), start, exporter)


def check_rank_splits(spec: LoraConfig, mesh: str, key: str) -> None:
    """Raises unless `spec.rank` divides by the mesh's fsdp size: where an adapter's other
    axis is not on `fsdp`, its rank is (`parallel.rules`, `lora_rank`)."""
    from jaxrl_lp.parallel import MeshSpec

    fsdp = MeshSpec.parse(mesh).fsdp
    if spec.rank % fsdp:
        raise ValueError(f"lora.rank={spec.rank} does not split over {key}={mesh}'s fsdp={fsdp} "
                         "(an adapter whose other axis is on the tensor axis is split over fsdp "
                         f"along its rank); choose a multiple of {fsdp}")


def _fingerprint(base) -> list[int]:
    return [int(x) for x in np.asarray(tree_fingerprint(base))]


def _model_json(mcfg) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(mcfg)))


def begin_lora(state: RunState, lora: LoraPlan, grpo_opt, run_dir: str | os.PathLike, mcfg,
               step: int) -> RunState:
    """The first GRPO step of a LoRA run on its own warm-start: the warm-started params become
    the frozen base (written once to `<run>/lora_base`), with fresh adapters and their GRPO
    optimizer state; the warm-start's optimizer state is dropped."""
    store = Checkpointer(run_dir, keep=1, subdir=BASE_DIR)
    try:
        if store.latest_step() != step:  # a resume re-entering this step has written it
            store.save(step, {"params": state.params}, {"model": _model_json(mcfg)})
    finally:
        store.close()
    train = lora.weights.from_params(state.params)
    return RunState(params=train, opt_sft={},
                    opt_grpo=grpo_opt.init(lora.weights.optimized(train)), sync=state.sync)


def _source(lora: LoraPlan, cfg) -> dict:
    if lora.start == 0:
        return {"kind": "init_from", "path": str(Path(cfg.init_from).absolute())}
    return {"kind": "warm_start", "path": BASE_DIR, "step": lora.start}


def _load_base(record: dict, run_dir, mcfg, shardings=None, init_from: str = "") -> dict:
    """The f32 params a record's base comes from (before `hold_base`)."""
    src = record["base_source"]
    if src["kind"] == "init_from":
        from jaxrl_lp.models.hf_io import load_hf_params

        path = init_from or src["path"]
        if not os.path.isdir(path):
            raise ValueError(f"the LoRA run in {run_dir} adapts the base in {src['path']} "
                             f"(init_from), which is not there; pass its directory as init_from")
        return load_hf_params(path, mcfg, shardings=shardings)
    store = Checkpointer(run_dir, create=False, subdir=BASE_DIR)
    try:
        params, _ = store.restore_params(int(src["step"]), mcfg)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"the LoRA run in {run_dir} adapts its warm-start of step {src['step']}, "
                         f"kept in {Path(run_dir) / BASE_DIR}, which cannot be read ({e})") from None
    finally:
        store.close()
    if shardings is not None:
        from jaxrl_lp.parallel.shard import put_tree

        params = put_tree(params, shardings)
    return params


def _check_base(record: dict, base, where) -> None:
    got = _fingerprint(base)
    if got != list(record["base_fingerprint"]):
        src = record["base_source"]
        raise ValueError(
            f"the LoRA adapters in {where} were trained on a base with fingerprint "
            f"{record['base_fingerprint']} ({src['kind']}: {src['path']}, held as "
            f"lora.base_format={record['base_format']}), but that source now gives {got}: "
            "another base. Resume or read the run with the base it was trained on (its "
            "init_from and lora.base_format), or train a new run.out_dir")


class LoraCheckpoints:
    """A `Checkpointer` for a LoRA run: its LoRA-phase checkpoints hold the adapters and their
    optimizer state, and the base's identity in the metadata (module docstring).

    `save` and `restore` take and give the run's full state tree (params a
    `LoraParams`); every other method is the wrapped checkpointer's.
    """

    def __init__(self, inner: Checkpointer, lora: LoraPlan, cfg, mcfg, optimizers, hooks,
                 shardings=None):
        self.inner, self.lora, self.cfg, self.mcfg = inner, lora, cfg, mcfg
        self.optimizers, self.hooks, self.shardings = optimizers, hooks, shardings
        self._record = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def record(self, base) -> dict:
        """The metadata of the LoRA phase: the adapters' settings and the base's identity.

        The base is fingerprinted at every save (one read of it per checkpoint) and must
        be the base the phase started on: a changed bit is a RuntimeError, not a checkpoint.
        """
        fp = _fingerprint(base)
        if self._record is None:
            spec = self.lora.spec
            self._record = {"rank": spec.rank, "alpha": spec.alpha, "targets": spec.targets,
                            "base_format": spec.base_format, "serve": spec.serve,
                            "start": self.lora.start, "base_source": _source(self.lora, self.cfg),
                            "base_fingerprint": fp}
        elif fp != self._record["base_fingerprint"]:
            raise RuntimeError(f"the frozen LoRA base changed during training (fingerprint "
                               f"{self._record['base_fingerprint']} -> {fp}); nothing was saved")
        return self._record

    def save(self, step: int, tree: dict, meta: dict) -> None:
        params = tree["params"]
        if isinstance(params, LoraParams):
            tree = {**tree, "params": {"adapters": params.adapters}}
            meta = {**meta, "lora": self.record(params.base)}
        self.inner.save(step, tree, meta)

    def restore(self, state_like: dict, model_config, step: int | None = None):
        step = self.inner.resolve_step(step)
        rec = self.inner.meta(step).get("lora")
        if rec is None:  # before the LoRA phase: the full model's state
            return self.inner.restore(state_like, model_config, step)
        spec = self.lora.spec
        diff = {k: (rec[k], getattr(spec, k)) for k in _SPEC_KEYS if rec[k] != getattr(spec, k)}
        if diff:
            raise ValueError(f"checkpoint step {step} of {self.inner.dir.parent} holds adapters "
                             f"of other LoRA settings ((checkpoint, config) = {diff}); resume "
                             "with the run's own lora settings, or start a new run.out_dir")
        sft_opt, grpo_opt = self.optimizers
        adapters = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, np.float32),
                                adapter_shapes(self.mcfg, spec),
                                is_leaf=lambda x: isinstance(x, tuple))
        opt_params = {"adapters": adapters}
        weights = self.lora.weights
        full = jax.eval_shape(lambda: init_params(self.mcfg, jax.random.PRNGKey(0)))
        like = {"params": opt_params,
                "opt_sft": jax.eval_shape(sft_opt.init, opt_params) if self.lora.start == 0 else {},
                "opt_grpo": jax.eval_shape(grpo_opt.init, opt_params),
                # The exporter state and diagnostics of the merged copy, as the phase made them.
                "sync": jax.eval_shape(lambda p: self.hooks.init_state(
                    weights.materialize(weights.from_params(p))), full)}
        tree, meta = self.inner.restore(like, model_config, step)
        held = state_like["params"]
        if isinstance(held, LoraParams):  # built from init_from by `initial_state`
            base = held.base
        else:
            base = hold_base(_load_base(rec, self.inner.dir.parent, self.mcfg, self.shardings),
                             spec.base_format)
        _check_base(rec, base, f"{self.inner.dir}/{step}")
        self._record = rec
        return {**tree, "params": LoraParams(base, tree["params"]["adapters"])}, meta


def read_lora_params(run_dir, params: Any, meta: dict, mcfg, init_from: str = ""):
    """The `LoraParams` of a LoRA checkpoint's params (`{"adapters": ...}`), its base rebuilt
    and checked; with the spec. Returns `(params, None)` for a checkpoint without LoRA."""
    rec = meta.get("lora")
    if rec is None:
        return params, None
    spec = LoraConfig(rank=rec["rank"], alpha=rec["alpha"], targets=rec["targets"],
                      base_format=rec["base_format"], serve=rec.get("serve", "unmerged"))
    base = hold_base(_load_base(rec, run_dir, mcfg, init_from=init_from), spec.base_format)
    _check_base(rec, base, run_dir)
    return LoraParams(base, params["adapters"]), spec
