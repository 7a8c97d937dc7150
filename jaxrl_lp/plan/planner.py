"""`plan(cfg, mesh, devices, target)`: a config's programs compiled at full size on N devices.

The GRPO learner step (one optimizer update on one minibatch, micro-batched as
the run does it), the behaviour log-probs of a step's whole batch (taken once
before the updates) and one step of the sampler's decode loop are lowered and
compiled on abstract inputs (`plan.inputs`) over a mesh of simulated devices
(`plan.devices`), exactly as a run shards them, and nothing is allocated.
The learner step comes in the forms the run uses (`train.behaviour.
ReplayRule`, `grpo.replay`): with hybrid log-probs, `grpo_step_recorded`
takes the rollout's recorded log-probs as its value (no replay: an update on
the weights the sampler ran, the first of a step, or every one under
`sync.loss_on_served`) and `grpo_step` replays (the later minibatches and
epochs, `grpo.mu` x `grpo.minibatches`); a dense learner has one form. The
summary counts how many updates of an iteration run each (`updates`), and
when the behaviour log-probs are computed at all. A packed step (the
padding-free learner, `models.packing`) is compiled at its largest bucket:
every slot real.
What one device holds and does is read from the compiled programs:

- memory: parameters, optimizer state and KV cache from their shapes and
  shardings; each program's arguments, outputs, temporaries and code from
  XLA's memory analysis. `learner_peak` is the largest peak of the GRPO
  step forms an iteration runs and, where they run, the behaviour
  log-probs' (plus the resident optimizer state);
  `sampler_peak` is the master parameters and optimizer state (resident
  while the sampler runs) plus the decode step's peak (its per-layer copy of
  the weights and the KV cache). `fits`: both within the target's HBM.
- lowering: each program is also lowered for the target's platform (`cuda`,
  `tpu`) from the same trace, with its kernels' tiles planned for the target
  (`kernels.targets`): `lowers_for` lists per program the Pallas kernels it
  carries there; a program that does not lower is an error naming it and why.
- time: FLOPs and bytes of each program (XLA's cost analysis, loop bodies
  once, and the loop-aware count of `plan.hlo_cost`) and the roofline bound
  on the target (`plan.roofline`), from which the learner's tokens/s and the
  sampler's decode tokens/s bounds follow, and a GRPO iteration's: N decode
  steps, the behaviour log-probs where they are computed, and each update
  priced as the program it runs.

A LoRA config (`lora.rank > 0`) is planned as it runs: the frozen base (as
`lora.base_format` holds it) and the adapters sharded by the rules, the GRPO
step differentiating and optimizing the adapters only, the sampler reading the
base and the adapters (or the merged copy, `lora.serve=merged`). Its `lora`
section sets the trained parameters and the optimizer state against full
fine-tuning's on the same mesh (`full_fine_tuning`, from shapes: the full
model's GRPO optimizer state is not compiled).

Low-precision compute dtypes are planned as they are stored on GPU/TPU
(natively, `plan.programs.native`), not as the f32 carrier used on
CPU. The sizes and the model come from `plan.request` (no data or weights are
read). The programs are the CPU compiler's, which is what can compile for N
simulated devices; a GPU or TPU compiler fuses differently (the CPU one, for
one, converts bf16 buffers to f32 around some updates and reads), so the
bytes are those of this compile, and `decode_tokens_per_s_ideal` gives the
bandwidth bound beside them (a decode step reads the weights and the KV
cache once).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxrl_lp.kernels.targets import for_target
from jaxrl_lp.models.blocks import unstack_layers
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.remat import Remat
from jaxrl_lp.parallel import MeshSpec, make_mesh, param_shardings, spec_for, use_mesh
from jaxrl_lp.parallel.shard import replicated
from jaxrl_lp.plan.inputs import (
    abstract,
    abstract_cache,
    abstract_params,
    abstract_rollout,
    abstract_rows,
    abstract_state,
    per_device_bytes,
    unstacked_shardings,
)
from jaxrl_lp.plan.offpolicy import offpolicy_estimate
from jaxrl_lp.plan.programs import native
from jaxrl_lp.plan.request import check_request
from jaxrl_lp.plan.roofline import cost_figures, memory_figures, roofline
from jaxrl_lp.plan.targets import Target
from jaxrl_lp.rl.logprob_programs import jit_learner_logprobs
from jaxrl_lp.rl.logprobs import pack_groups
from jaxrl_lp.rl.train_step import make_grpo_step
from jaxrl_lp.rollout.step import LoopSpec, decode_step, fused_readout, step_logits
from jaxrl_lp.train.behaviour import iteration_counts
from jaxrl_lp.train.config import TrainConfig
from jaxrl_lp.train.logprobs_choice import choose_logprobs, with_logprobs

__all__ = ["iteration_updates", "plan"]


def _compiled_figures(compiled, seconds: float, tgt: Target) -> dict:
    xla, walk = cost_figures(compiled)
    return {"compile_s": round(seconds, 1), "memory": memory_figures(compiled),
            "xla_cost_analysis": xla,
            "loop_aware": {"flops": walk.flops, "bytes": walk.bytes,
                           "collective_bytes": walk.collective_bytes,
                           "unknown_trip_loops": walk.unknown_trip_loops},
            "roofline": roofline(walk.flops, walk.bytes, tgt)}


def _compile(jitted, args, lowered_for: dict, name: str, tgt: Target):
    """The CPU compile of `jitted(*args)` (XLA's memory and cost figures) and its seconds; the
    same trace is also lowered for the target's platform, into `lowered_for[name]`."""
    t0 = time.perf_counter()
    traced = jitted.trace(*args)
    compiled = traced.lower().compile()
    seconds = time.perf_counter() - t0
    lowered_for[name] = _lower_for_target(traced, name, tgt)
    return compiled, seconds


def _lower_for_target(traced, name: str, tgt: Target) -> dict:
    """`{lowers, kernels, seconds}` of a traced program lowered for `tgt`'s platform.

    Raises:
      ValueError: the program does not lower there (naming it, the platform and why).
    """
    from collections import Counter

    from jaxrl_lp.kernels.lowering import kernel_calls, lower_for

    t0 = time.perf_counter()
    try:
        text = lower_for(traced, tgt.platform, tgt.name)
    except Exception as e:
        raise ValueError(f"plan: the {name} program does not lower for {tgt.platform} "
                         f"({tgt.name}): {type(e).__name__}: {e}") from e
    return {"lowers": True, "kernels": dict(sorted(Counter(kernel_calls(text, tgt.platform)).items())),
            "seconds": round(time.perf_counter() - t0, 1)}


def plan(cfg: TrainConfig, mesh: str, devices: int, target: str = "h100", *,
         prompt_len: int | None = None, remat: Remat | bool | str | None = None) -> dict:
    """Compiles `cfg`'s GRPO step and decode step on `devices` devices; per-device figures.

    Args:
      cfg: the training config (its model, GRPO batch and policies, loss).
      mesh: the mesh spec, e.g. `fsdp=8` (`parallel.MeshSpec`).
      devices: how many devices; the first `devices` of `jax.devices()` are
        used (`plan.devices.use_simulated_devices` makes them).
      target: a key of `plan.targets.TARGETS` for the roofline and `fits`.
      prompt_len: padded prompt slots (default: the task's bucket).
      remat: what the learner's backward recomputes (`models.remat.Remat`, as
        `make_grpo_step(remat=...)`; default: the config's `grpo.remat`, as the
        training program runs).

    Returns:
      A JSON-ready dict (module docstring; bytes, FLOPs and seconds per device).

    Raises:
      ValueError: a bad request (`check_request`), or fewer devices than asked.
    """
    spec, tgt, mcfg, shp = check_request(cfg, mesh, devices, target, prompt_len)
    if jax.device_count() < devices:
        raise ValueError(f"plan needs {devices} devices but jax has {jax.device_count()}; run "
                         f"`jaxrl-lp plan`, which simulates them")
    from jaxrl_lp.train.optimizers import make_optimizers

    m = make_mesh(spec, jax.devices()[:devices])
    if cfg.grpo.logprobs == "auto":  # as a run on the target would resolve it
        cfg = with_logprobs(cfg, choose_logprobs(cfg, mesh=m if devices > 1 else None,
                                                 platform=tgt.platform))
    g = cfg.grpo
    lpol, spol = (native(p) for p in g.policies)
    loop = LoopSpec(g.exit_rule, g.compute_mode).resolve(mcfg)
    grpo_opt = make_optimizers(cfg)[1]
    from jaxrl_lp.train.lora_run import lora_plan

    lora = lora_plan(cfg, mcfg)
    if lora is not None:
        from jaxrl_lp.train.lora_run import check_rank_splits

        check_rank_splits(lora.spec, mesh, "--mesh")
    lowered_for: dict = {}
    with for_target(tgt.name):
        params, psh = abstract_params(mcfg, m)
        full_opt = abstract_state(grpo_opt.init, params, psh, m)
        if lora is None:
            train, opt, view, lora_info = params, full_opt, params, None
        else:  # the frozen base as held and the adapters, each sharded by the rules
            train = jax.eval_shape(lora.weights.from_params, params)
            train = abstract(train, param_shardings(train, mcfg, m))
            opt_params = lora.weights.optimized(train)
            opt = abstract_state(grpo_opt.init, opt_params,
                                 jax.tree.map(lambda x: x.sharding, opt_params), m)
            view = lora.weights.materialize(train)  # what the learner's forward reads
            lora_info = _lora_figures(lora, train, opt, params, full_opt)
        merged = lora is not None and lora.spec.serve == "merged"
        on_served = (cfg.sync.exporter != "none" or merged) and cfg.sync.loss_on_served
        served = params if on_served else None  # the served copy: dense, f32 carriers
        ro = abstract_rollout(shp.rows, shp.prompt_len, shp.max_new, spol, loop, g.temperature, m)
        logp_N = abstract_rows((shp.rows, shp.max_new), jnp.float32, m)
        args = (train, opt, ro, abstract_rows((shp.rows,), jnp.float32, m), logp_N, None, served)
        step = make_grpo_step(mcfg, lpol, cfg.loss, grpo_opt, loop=loop, sampler_policy=spol,
                              method=g.logprobs, micro_batches=g.micro_batches, mesh=m,
                              remat=Remat.of(g.remat if remat is None else remat),
                              weights=None if lora is None else lora.weights)
        if step.packs:  # its largest bucket: every slot of a packing group real
            per = shp.micro_rows // pack_groups(shp.micro_rows, m)
            step = step.with_packed_rows((per * (shp.prompt_len + shp.max_new),
                                          per * shp.max_new))
        # The step's own mesh program: parameters and optimizer state by the rules
        # (donated), rollout rows over the data shards, replicated metrics. A hybrid
        # learner's replaying form, and its form given the rollout's log-probs as the value.
        grpo, grpo_s = _compile(step, args, lowered_for, "grpo_step", tgt)
        recorded = None
        if g.logprobs == "hybrid":
            recorded = _compile(step, (*args, logp_N), lowered_for, "grpo_step_recorded", tgt)
        # The behaviour log-probs of the whole step's batch, before the updates (the
        # training program's `old_logp_fn`): one call, micro-batched as the run slices it.
        whole = abstract_rollout(shp.decode_batch, shp.prompt_len, shp.max_new, spol, loop,
                                 g.temperature, m)
        slices = g.minibatches * g.micro_batches
        behaviour = jit_learner_logprobs(mcfg, lpol, g.logprobs, loop=loop, mesh=m,
                                         micro_batches=slices)
        if behaviour.packs:
            per = shp.decode_batch // slices
            per //= pack_groups(per, m)
            behaviour = behaviour.with_packed_rows((per * (shp.prompt_len + shp.max_new),
                                                    per * shp.max_new))
        logp, logp_s = _compile(behaviour, (view if served is None else served, whole),
                                lowered_for, "behaviour_logprobs", tgt)

        b, slots = shp.decode_batch, shp.prompt_len + shp.max_new
        # The sampler decodes from a per-layer copy of the weights, as `generate` does: the
        # (f32) master, a LoRA run's base and adapters, or its merged copy.
        decoded = params if lora is None or merged else view
        ush = unstacked_shardings(jax.tree.map(lambda x: x.sharding, decoded), mcfg.num_layers)
        sampler_params = abstract(jax.eval_shape(unstack_layers, decoded), ush)
        cache = abstract_cache(mcfg, spol, b, slots, m)
        rows = lambda dtype: abstract_rows((b,), dtype, m)
        active = rows(jnp.bool_) if loop.compute_mode == "deferred" else None
        dargs = (sampler_params, rows(jnp.int32), rows(jnp.int32), cache,
                 jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated(m)), active)

        def decode(params, tokens_B, positions_B, cache, index, active_B):
            # As `generate` runs it: the hidden state where the read-out may fuse, its logits.
            with use_mesh(m):
                fused = fused_readout(spol)
                out, cache, exits, evals = decode_step(params, mcfg, spol, loop, tokens_B,
                                                       positions_B, cache, index,
                                                       active_B=active_B, hidden=fused)
                return step_logits(params, mcfg, spol, out), cache, exits, evals

        # Logits by batch and vocabulary; the cache keeps its sharding and is updated in
        # place (donated), as in the sampler's loop.
        cache_sh = jax.tree.map(lambda x: x.sharding, cache)
        dout = (NamedSharding(m, spec_for(("batch", "vocab"), mesh=m)), cache_sh,
                rows(jnp.int32).sharding, replicated(m))
        dec, dec_s = _compile(jax.jit(decode, out_shardings=dout, donate_argnums=(3,)), dargs,
                              lowered_for, "decode_step", tgt)

    out = {"model": {"family": mcfg.family, "params": mcfg.param_count(),
                     "layers": mcfg.num_layers, "loop_steps": mcfg.loop_steps},
           "mesh": str(spec), "devices": devices,
           "target": {"name": tgt.name, "peak_flops": tgt.peak_flops,
                      "hbm_bandwidth": tgt.hbm_bandwidth, "hbm_bytes": tgt.hbm_bytes,
                      "source": tgt.source},
           "policies": {"learner": str(lpol), "sampler": str(spol), "loop": str(loop)},
           "shapes": shp._asdict(),
           "per_device_bytes": {"params": per_device_bytes(train),
                                "optimizer_state": per_device_bytes(opt),
                                "kv_cache": per_device_bytes(cache),
                                "rollout": per_device_bytes(ro),
                                "decode_weights_read": _weights_read(decoded, mcfg, spec)},
           "grpo_step": _compiled_figures(grpo, grpo_s, tgt),
           **({} if recorded is None else
              {"grpo_step_recorded": _compiled_figures(*recorded, tgt)}),
           "behaviour_logprobs": _compiled_figures(logp, logp_s, tgt),
           "decode_step": _compiled_figures(dec, dec_s, tgt),
           "lowers_for": {"platform": tgt.platform, "target": tgt.name,
                          "programs": lowered_for}}
    if lora_info is not None:
        out["lora"] = lora_info
    out = _summarize(out, cfg, tgt)
    # The sampler and the learner on devices of their own, overlapped (`grpo.max_staleness`).
    out["summary"]["offpolicy"] = offpolicy_estimate(
        out, spec, tgt, iteration_updates(cfg), iteration_updates(cfg, stale=True))
    return out


def _lora_figures(lora, train, opt, full_params, full_opt) -> dict:
    """A LoRA plan's trained parameters and per-device state against full fine-tuning's."""
    count = lambda t: int(sum(x.size for x in jax.tree.leaves(t)))
    per = {"params": per_device_bytes(train), "optimizer_state": per_device_bytes(opt)}
    full = {"params": per_device_bytes(full_params), "optimizer_state": per_device_bytes(full_opt)}
    spec = lora.spec
    return {"rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.target_weights()),
            "base_format": spec.base_format, "serve": spec.serve,
            "trained_params": count(train.adapters), "full_trained_params": count(full_params),
            "trained_fraction": count(train.adapters) / count(full_params),
            "per_device_bytes": per, "full_fine_tuning_per_device_bytes": full,
            "optimizer_state_vs_full": per["optimizer_state"] / full["optimizer_state"]}


def _weights_read(params, mcfg: ModelConfig, spec: MeshSpec) -> int:
    """Weight bytes one device reads in a decode step: every layer once per loop step and
    the output head, gathered over `fsdp` and split over `tensor` (the sampler's copy: f32,
    or a LoRA run's base as held and its adapters)."""
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    head = params["embed"] if mcfg.tie_embeddings else params["lm_head"]
    return int((nbytes(params["layers"]) * mcfg.loop_steps + nbytes(head)) // spec.tensor)


def iteration_updates(cfg: TrainConfig, stale: bool = False) -> dict:
    """Which learner programs one GRPO iteration of `cfg` runs, and how often: the host rules
    of `train.behaviour.iteration_counts`, with `grpo.logprobs=auto` resolved as a
    single-turn run here resolves it (`train.logprobs_choice`).

    Returns:
      `{"recorded", "replaying", "dense", "behaviour"}` (counts per iteration).
    """
    if cfg.grpo.logprobs == "auto":
        cfg = with_logprobs(cfg, choose_logprobs(cfg))
    return iteration_counts(cfg, stale)


def _summarize(out: dict, cfg: TrainConfig, tgt: Target) -> dict:
    """Adds the headline figures: peaks, `fits`, tokens/s bounds, a GRPO iteration's time."""
    shp, per = out["shapes"], out["per_device_bytes"]
    counts = iteration_updates(cfg)
    programs = {"replaying": out["grpo_step"], "dense": out["grpo_step"],
                "recorded": out.get("grpo_step_recorded")}
    runs = [k for k in ("recorded", "replaying", "dense") if counts[k]]
    # The programs the iteration runs; the optimizer state stays resident while the
    # log-probs are taken and while sampling.
    learner = max(programs[k]["memory"]["peak"] for k in runs)
    if counts["behaviour"]:
        learner = max(learner,
                      per["optimizer_state"] + out["behaviour_logprobs"]["memory"]["peak"])
    sampler = per["params"] + per["optimizer_state"] + out["decode_step"]["memory"]["peak"]
    update_s = {k: programs[k]["roofline"]["time_s"] for k in runs}
    updates_s = sum(counts[k] * t for k, t in update_s.items())
    n_updates = sum(counts[k] for k in update_s)
    decode_s = out["decode_step"]["roofline"]["time_s"]
    behaviour_s = counts["behaviour"] * out["behaviour_logprobs"]["roofline"]["time_s"]
    out["summary"] = {
        "learner_peak_bytes": learner, "sampler_peak_bytes": sampler,
        "fits": max(learner, sampler) <= tgt.hbm_bytes,
        # An update's tokens over its mean bound in this iteration.
        "learner_tokens_per_s": shp["rows"] * (shp["prompt_len"] + shp["max_new"])
        / (updates_s / n_updates),
        "decode_tokens_per_s": shp["decode_batch"] / decode_s,
        # The decode bound: a step reads the weights and the KV cache once.
        "decode_tokens_per_s_ideal": shp["decode_batch"] * tgt.hbm_bandwidth
        / (per["decode_weights_read"] + per["kv_cache"]),
        # What one iteration runs (`iteration_updates`): updates by program, and how many
        # behaviour log-prob passes.
        "updates": {k: counts[k] for k in update_s},
        "behaviour_passes": counts["behaviour"],
        # The bound of one update of each program the iteration runs.
        "update_s": update_s,
        # N decode steps, the behaviour log-probs where computed, then each update as the
        # program it runs (prefill left out): the least time one GRPO iteration takes.
        "iteration_s": shp["max_new"] * decode_s + behaviour_s + updates_s,
    }
    return out
