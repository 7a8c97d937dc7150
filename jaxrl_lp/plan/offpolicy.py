"""The planner's estimate of an off-policy run: the sampler and the learner on their own devices.

A plan compiles the programs on one mesh of N devices, which the sampler and
the learner share in turn (`grpo.max_staleness=0`): its `iteration_s` is the
decode loop, the behaviour log-probs and the updates, one after another. With
`run.sampler_mesh=data=k` and `run.learner_mesh` over the other N - k
devices, `grpo.max_staleness=1` overlaps the two, and an iteration takes the
longer of them. This module derives both from the N-device figures, without
compiling again:

- Sampler, k replicas (`train.rollout_queue.SamplerSide`): each holds the
  whole model and decodes decode_batch / k rows. Per replica and decode step,
  the weight bytes are the N-device step's weights read times the tensor
  split (a replica reads every weight), and its FLOPs and other bytes (KV
  cache, activations) scale with its rows against the N-device step's rows
  per device (and the tensor split); the roofline of those is the step.
- Learner, N - k devices: every per-device FLOP and byte of its programs
  scales by N / (N - k) (the same program over fewer devices, fully sharded:
  linear in the roofline). Which programs run, and how often, is
  `plan.iteration_updates`: a synchronous iteration's on the split, a stale
  rollout's (the behaviour log-probs every step, the first update given them)
  when overlapped.

These are estimates on the target's roofline, as the plan's other times are;
a split whose replica does not fit the target's memory is marked `fits: false`.
"""

from __future__ import annotations

__all__ = ["offpolicy_estimate"]


def _learn_s(out: dict, counts: dict) -> float:
    """A GRPO iteration's learner seconds on the plan's N devices for `counts`."""
    programs = {"recorded": out.get("grpo_step_recorded"), "replaying": out["grpo_step"],
                "dense": out["grpo_step"]}
    updates = sum(counts[k] * programs[k]["roofline"]["time_s"]
                  for k in ("recorded", "replaying", "dense") if counts[k])
    return updates + counts["behaviour"] * out["behaviour_logprobs"]["roofline"]["time_s"]


def offpolicy_estimate(out: dict, spec, target, synchronous: dict, stale: dict) -> dict:
    """The synchronous and overlapped iteration seconds for each split of the N devices.

    Args:
      out: a plan's result (`plan.planner.plan`, its `summary` filled in).
      spec: the planned mesh (`parallel.MeshSpec`).
      target: the plan's `plan.targets.Target`.
      synchronous: `plan.iteration_updates(cfg)`, what a synchronous iteration runs.
      stale: `plan.iteration_updates(cfg, stale=True)`, what an iteration on a rollout
        sampled on the previous export runs.

    Returns:
      `{"synchronous_s", "stale_updates", "splits": [...], "best": {...}, "speedup"}`:
      the shared N-device iteration (the plan's `iteration_s`), the stale iteration's
      program counts, per sampler device count k the sample and learn seconds, the
      synchronous and overlapped iteration on that split and whether a replica fits,
      the fastest fitting split, and the shared iteration over its overlapped one.
    """
    n, shp, per = out["devices"], out["shapes"], out["per_device_bytes"]
    dec = out["decode_step"]["loop_aware"]
    weights = per["decode_weights_read"]
    rows_per_device = shp["decode_batch"] / spec.data_shards
    learn_sync, learn_stale = _learn_s(out, synchronous), _learn_s(out, stale)
    # A replica's copy of the model: the parameters are split over fsdp and tensor.
    model_bytes = per["params"] * spec.fsdp * spec.tensor
    splits = []
    for k in range(1, n):
        if shp["decode_batch"] % k:
            continue
        scale = (shp["decode_batch"] / k) / rows_per_device * spec.tensor
        flops = dec["flops"] * scale
        nbytes = weights * spec.tensor + (dec["bytes"] - weights) * scale
        decode_s = max(flops / target.peak_flops, nbytes / target.hbm_bandwidth)
        sample = shp["max_new"] * decode_s
        learn = learn_stale * n / (n - k)
        replica = model_bytes + per["kv_cache"] * scale
        splits.append({"sampler_devices": k, "learner_devices": n - k,
                       "sample_s": sample, "learn_s": learn,
                       "synchronous_split_s": sample + learn_sync * n / (n - k),
                       "overlapped_s": max(sample, learn),
                       "sampler_replica_bytes": int(replica), "fits": replica <= target.hbm_bytes})
    fitting = [s for s in splits if s["fits"]]
    best = min(fitting, key=lambda s: s["overlapped_s"]) if fitting else None
    sync = out["summary"]["iteration_s"]
    return {"synchronous_s": sync, "stale_updates": stale, "splits": splits, "best": best,
            "speedup": None if best is None else sync / best["overlapped_s"]}
