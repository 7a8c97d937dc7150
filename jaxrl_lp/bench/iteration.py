"""The iteration benchmark: whole GRPO iterations (rollout + update) of ours against Tunix's.

One GRPO iteration is what the training program does per step
(`train.grpo_iteration`): sample G completions for each of B / G prompts,
score them, compute the group advantages, take the behaviour log-probs, and
run the updates (`--minibatches` optimizer steps on row slices of the batch,
one pass: mu = 1). Both sides start from the same random weights of the
dense preset (`--size`: `small-qwen3`, 8 layers, hidden 512, vocab 32000, by
default; `qwen3-0.6b` on a GPU), saved as a Hugging Face
checkpoint that Tunix loads with its own Qwen3 loader, and race alternately
after a warm-up (`bench.sampler._race`, the fastest iteration reported, with
its per-phase split).

Ours, per method (`--methods`):
- `hybrid`: `grpo.logprobs=hybrid`, `grpo.replay=auto`, the default. The
  rollout records its log-probs and the fingerprint of the weights it ran
  (`Rollout.weights_digest`); the behaviour log-probs and the first update's
  hybrid value are the rollout's own, and the updates after the first (the
  later minibatches) replay, since the weights have moved
  (`train.behaviour.ReplayRule`). The fingerprint's cost is in `behaviour`.
- `dense`: `grpo.logprobs=dense`; the behaviour log-probs are one forward of
  the learner (what the program computes for a dense learner).
- `traced`: `hybrid` with the exact replay's mechanism off: an update that
  replays (a later minibatch) takes its value from the sampler's steps traced
  at the minibatch's shape (`rollout.replay.traced_replay_logprobs`, the
  construction before the replay was the sampler's own program: not the
  sampler's bits on a GPU), where `hybrid` runs the sampler's program over
  the minibatch's whole call. `hybrid` against `traced` at more than one
  minibatch is what the mechanism costs an iteration.
- `invariant`: `grpo.logprobs=invariant`: the sampler decodes in the
  batch-invariant forms (the decode layout `invariant`, `numerics.invariant`)
  and the update is the hybrid's, its value the rollout's own where the
  hybrid's is and, where the hybrid replays, the minibatch's parallel forward
  in the same forms (the sampler's bits, a forward-only program); the
  behaviour log-probs are the rollout's (the same digest rule as `hybrid`),
  and its verification is that forward of the whole batch (`verify_replay_s`).
- `products`: `hybrid` with `grpo.reuse_products=true`: the rollout also
  keeps the sampler's weight products and logits (`models.recorded`), and an
  update at the sampler's weights (the first) reads them instead of
  computing its forward's matmuls; the later minibatches run as `hybrid`'s.
The training program also replays the whole batch every `grpo.verify_every`
(default 10) steps to prove replay == sampler; that replay is timed apart
(`verify_replay_s`) and `hybrid_with_verify_tokens_per_s` adds a tenth of it
to the hybrid iteration.

Tunix (`google-tunix`, the `bench` extra, in its own venv): its vanilla
rollout engine (`tunix.rl.rollout.vanilla_rollout.VanillaRollout`, the
`Sampler` its RL cluster drives) on its Qwen3 model, then the completion
padding and masks its GRPO learner builds (`GRPOLearner.
_generate_and_compute_advantage`), its registered `grpo` advantage
estimator, its RL trainer's jitted GRPO update per minibatch
(`bench.tunix_ref.tunix_update`) and its weight sync to the rollout
(`RLCluster.sync_weights`: `update_params` of the actor's params). With
num_iterations = 1 Tunix computes no old log-probs (its ratio is 1 in
every minibatch, the later ones included); ours replays there, so the
later minibatches' ratios are the true policy ratios. What both leave out
is the same: data loading, the reward function (both score the same token
ids with `iteration_ours.reward`, a toy), metric buffering and logging.

Each entry's fastest iteration also carries what it cost the process
beyond its wall seconds (`getrusage`): `page_faults` (minor faults: fresh
pages the kernel zeroed, docs/design/host_memory.md "Host memory on CPU"),
`kernel_cpu_s` and `user_cpu_s` (both cores together).

Sampling: temperature 1.0, no top-k/top-p (Tunix's `top_p=1.0` takes the
same categorical draw), every sequence runs `--new-tokens` tokens (no EOS
stop; Tunix gets an EOS id that never occurs), so both do the same work.
Tokens/s counts the B x `--new-tokens` sampled tokens of an iteration.
Ours draws by Gumbel-max (`jax.random.categorical`, as Tunix); `--draws
gumbel,inverse_cdf` races `grpo.draw=inverse_cdf` too (`<method>_mb<k>_inverse_cdf`:
the same distribution, other tokens per key, `rollout.sampling.draw_categorical`).

Our sampler decodes in the layout `generate` picks for the weights
(`rollout.step.decode_layout`: `transposed` on CPU, docs/design/hot_path.md "The
decode's weights"); each entry says which (`decode_layout`). `--decode-layouts
auto,as_stored` races the stored layout beside it (`<method>_mb<k>_as_stored`),
the replays following each rollout's layout.

A looped preset (`--looped-size`: the `small-qwen3` shapes as an Ouro-style
model, R = 4, by default; or a looped model preset, `ouro-1.4b`) runs ours
only: Tunix has no looped model (and `products` is a dense model's).

The roofline (`bench.roofline`, module docstring there, which also assembles
the bounds): in the same process
and run, before and after the race, this machine's weight-stream bandwidth
(a batch-B matrix-vector pass over the dense preset's decode weights) and
f32 matmul rate (the update's matmuls at its B x (prompt + new) rows) are
measured (`machine`; the better of the two measurements is used). Every
entry then gets `bounds`: the least seconds of its sample phase (every
sampled token one pass over the weights a decode step reads), of its
updates (each compiled update program's loop-aware FLOPs, `plan.hlo_cost`,
over the matmul rate; a replaying update at least its decode loop's weight
stream) and of a dense learner's behaviour forward, and `fraction_of_bound`
(bound / measured seconds: 1 is at the bound). Tunix's entries are put
against the same bounds: the work of our compiled update (which skips the
padding; Tunix computes every slot). `max_ratio_vs_tunix_at_bound` is the
iteration ratio ours would have against that Tunix run if ours ran at its
bounds: Tunix's measured iteration over our bound iteration. `--no-roofline`
skips it.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import tempfile

import jax
import numpy as np
import optax

from jaxrl_lp.bench import tunix_ref
from jaxrl_lp.bench.iteration_ours import OurIteration, reward
from jaxrl_lp.bench.learner import LOSS, PAD_ID, SIZES
from jaxrl_lp.bench.roofline import add_bounds, best_machine, measure_machine
from jaxrl_lp.bench.sampler import LOOPED_SIZES, _first_call, _race
from jaxrl_lp.models.config import ModelConfig, get_preset
from jaxrl_lp.models.hf_io import save_hf_checkpoint
from jaxrl_lp.models.model import init_params
from jaxrl_lp.numerics.invariant import InvariantForm
from jaxrl_lp.numerics.policy import policy_arg
from jaxrl_lp.rollout import LoopSpec
from jaxrl_lp.rollout.sampling import DRAWS
from jaxrl_lp.rollout.step import DECODE_LAYOUTS

__all__ = ["add_arguments", "run"]

NO_EOS = -1  # an EOS id no sampled token equals: every sequence runs to --new-tokens
VERIFY_EVERY = 10  # grpo.verify_every's default
TARGET_VS_TUNIX = 1.5
METHODS = ("hybrid", "traced", "dense", "products", "invariant")


def _prompts(cfg: ModelConfig, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return rng.randint(3, cfg.vocab_size, (n, length)).tolist()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `jaxrl-lp bench iteration`."""
    parser.add_argument("--size", default="small",
                        help="dense preset raced against Tunix: small (small-qwen3), tiny, or "
                             "a dense model preset (qwen3-0.6b on a GPU)")
    parser.add_argument("--looped-size", default="small",
                        help="looped preset, ours only: small or tiny (the dense preset's "
                             "shapes, Ouro-style, R=4), or a looped model preset (ouro-1.4b); "
                             "'' to skip")
    parser.add_argument("--batch", type=int, default=8, help="sequences B per iteration")
    parser.add_argument("--group", type=int, default=4, help="GRPO group size G (divides B)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=112,
                        help="sampled tokens per sequence (prompt + these = the learner "
                             "bench's 128)")
    parser.add_argument("--minibatches", default="1,4",
                        help="optimizer steps per iteration to race (comma list; each divides B)")
    parser.add_argument("--methods", default="hybrid,dense,products",
                        help="ours: hybrid, traced (hybrid with the former traced replay "
                             "of a later minibatch: the exact replay's cost), dense, products "
                             "(hybrid with grpo.reuse_products; dense presets only)")
    parser.add_argument("--policy", default="fp32", type=policy_arg,
                        help="our precision policy (fp32 on CPU: docs/design/low_precision.md); Tunix gets "
                             "its compute dtype")
    parser.add_argument("--draws", default="gumbel",
                        help="our sampler's token draws to race (comma list of gumbel, "
                             "inverse_cdf: `grpo.draw`); a non-default one is named "
                             "<method>_mb<k>_<draw>")
    parser.add_argument("--decode-layouts", default="auto",
                        help="our sampler's decode layouts to race (comma list of auto, "
                             "as_stored, transposed: `rollout.step.decode_layout`; auto lets "
                             "`generate` pick); a non-auto one is named <method>_mb<k>_<layout>")
    parser.add_argument("--invariant-tiles", default="", choices=("", "compiled", "interpret-tpu"),
                        help="the invariant method's products in fixed tiles "
                             "(`grpo.invariant_tiles`: compiled on a GPU or TPU, interpreted "
                             "anywhere); '': XLA's forms, this CPU's")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed iterations of each after the warm-up (at least)")
    parser.add_argument("--min-time", type=float, default=0.0,
                        help="keep alternating until each took about this many seconds")
    parser.add_argument("--no-tunix", action="store_true", help="skip the Tunix reference")
    parser.add_argument("--no-roofline", action="store_true",
                        help="skip the machine's bandwidth and matmul rate and the bounds")
    parser.add_argument("--seed", type=int, default=0)


def _check(args) -> tuple[list[int], list[str], list[str], list[str]]:
    if args.batch % args.group or args.group < 2:
        raise ValueError("--group must be >= 2 and divide --batch")
    for name in ("prompt_len", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    mbs = [int(s) for s in args.minibatches.split(",") if s.strip()]
    if not mbs or any(m < 1 or args.batch % m for m in mbs):
        raise ValueError(f"--minibatches: each must be >= 1 and divide --batch {args.batch}; "
                         f"got {args.minibatches!r}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or any(m not in METHODS for m in methods):
        raise ValueError(f"--methods: some of {', '.join(METHODS)}; got {args.methods!r}")
    draws = [d.strip() for d in args.draws.split(",") if d.strip()]
    if not draws or any(d not in DRAWS for d in draws):
        raise ValueError(f"--draws: gumbel and/or inverse_cdf; got {args.draws!r}")
    layouts = [x.strip() for x in args.decode_layouts.split(",") if x.strip()]
    if not layouts or any(x not in ("auto", *DECODE_LAYOUTS) for x in layouts):
        raise ValueError(f"--decode-layouts: some of auto, {', '.join(DECODE_LAYOUTS)}; got "
                         f"{args.decode_layouts!r}")
    if getattr(args, "invariant_tiles", "") and "invariant" not in methods:
        raise ValueError(f"--invariant-tiles {args.invariant_tiles}: the invariant method's "
                         "products; add invariant to --methods")
    return mbs, methods, draws, layouts


def _presets(args) -> tuple[tuple[str, ModelConfig], tuple[str, ModelConfig] | None]:
    """`--size` and `--looped-size` as (name, config); a preset of the wrong kind is an
    error naming the option it belongs to."""
    if args.size in SIZES:
        dense = SIZES[args.size], get_preset(SIZES[args.size])
    else:
        dense = args.size, get_preset(args.size)
        if dense[1].is_looped:
            raise ValueError(f"--size {args.size!r} is a looped preset; pass it to --looped-size")
    if not args.looped_size:
        return dense, None
    if args.looped_size in LOOPED_SIZES:
        cfg = LOOPED_SIZES[args.looped_size]
        return dense, (f"{SIZES[args.looped_size]}-looped-r{cfg.loop_steps}", cfg)
    cfg = get_preset(args.looped_size)
    if not cfg.is_looped:
        raise ValueError(f"--looped-size {args.looped_size!r} is a dense preset; pass it to "
                         "--size")
    return dense, (args.looped_size, cfg)


def _summary(times: dict, phases: dict, tokens: int) -> dict:
    out = {}
    for name, ts in times.items():
        best = int(np.argmin(ts))
        split = phases[name][best]
        out[name] = {"iteration_s": round(ts[best], 4), "runs": len(ts),
                     "tokens_per_s": round(tokens / ts[best], 1),
                     **{k.removeprefix("timing_s/"): round(v, 4) for k, v in split.items()
                        if k.startswith("timing_s/") and k != "timing_s/iteration"},
                     **{k: v for k, v in split.items() if not k.startswith("timing_s/")}}
    return out


def _race_iterations(calls: dict, repeats: int, min_time: float):
    phases = {m: [] for m in calls}

    def recorder(name, fn):
        def call():  # with what the iteration cost the process beyond its wall seconds
            before = resource.getrusage(resource.RUSAGE_SELF)
            out = fn()
            after = resource.getrusage(resource.RUSAGE_SELF)
            phases[name].append({**out, "page_faults": after.ru_minflt - before.ru_minflt,
                                 "kernel_cpu_s": round(after.ru_stime - before.ru_stime, 3),
                                 "user_cpu_s": round(after.ru_utime - before.ru_utime, 3)})
            return out
        return call

    # Two warm-up iterations each: a jitted step's second call can compile once more (its
    # inputs are then the first call's committed, donated-into outputs; seen with Tunix's).
    firsts = {}
    for m, fn in calls.items():
        firsts[m] = _first_call(fn)[0]
    _, times, _ = _race({m: recorder(m, fn) for m, fn in calls.items()}, repeats, min_time)
    for m in calls:  # the second warm-up's phases are not a timed run's
        phases[m] = phases[m][1:]
    return firsts, times, phases


def _preset_race(cfg, policy, args, mbs, methods, draws, layouts, optimizer, tunix_ckpt=None,
                 machine=None) -> tuple[dict, dict]:
    params = init_params(cfg, jax.random.PRNGKey(args.seed))
    prompts = _prompts(cfg, args.batch // args.group, args.prompt_len, args.seed)
    common = dict(group=args.group, new_tokens=args.new_tokens, seed=args.seed)
    form = InvariantForm(0, None, args.invariant_tiles) if args.invariant_tiles else None
    ours = {f"{m}_mb{k}" + ("" if d == "gumbel" else f"_{d}")
            + ("" if lay == "auto" else f"_{lay}"): OurIteration(
                cfg, policy, params, prompts, optimizer, method=m, minibatches=k,
                loop=LoopSpec(), pack_buckets=16, draw=d,
                layout=None if lay == "auto" else lay, form=form, **common)
            for k in mbs for m in methods for d in draws for lay in layouts
            if not (m == "products" and cfg.is_looped)}  # products: dense models
    calls = dict(ours)
    if tunix_ckpt is not None:
        save_hf_checkpoint(tunix_ckpt, cfg, params, dtype="f32")
        for k in mbs:
            calls[f"tunix_mb{k}"] = tunix_ref.TunixIteration(
                tunix_ckpt, cfg, policy, prompts, optimizer, minibatches=k, loss=LOSS,
                pad_id=PAD_ID, eos_id=NO_EOS, reward=reward, **common)
    firsts, times, phases = _race_iterations(calls, args.repeats, args.min_time)
    tokens = args.batch * args.new_tokens
    res = _summary(times, phases, tokens)
    for name, it in ours.items():
        res[name]["first_call_s"] = round(firsts[name], 2)
        if it.method != "dense":
            v = it.verify_seconds()
            res[name]["verify_replay_s"] = round(v, 4)
            with_verify = res[name]["iteration_s"] + v / VERIFY_EVERY
            res[name]["with_verify_tokens_per_s"] = round(tokens / with_verify, 1)
    for k in mbs:
        if f"tunix_mb{k}" not in res:
            continue
        theirs = res[f"tunix_mb{k}"]["tokens_per_s"]
        for name in [n for n in ours if n.split("_mb")[1].split("_")[0] == str(k)]:
            mine = res[name]
            mine["vs_tunix"] = round(mine["tokens_per_s"] / theirs, 3)
            if "with_verify_tokens_per_s" in mine:
                mine["with_verify_vs_tunix"] = round(mine["with_verify_tokens_per_s"] / theirs, 3)
    return {"params": cfg.param_count(), "tokens_per_iteration": tokens, **res}, ours


def run(args: argparse.Namespace) -> dict:
    """Runs the benchmark; returns one JSON-serializable dict."""
    mbs, methods, draws, layouts = _check(args)
    (dense_name, dense_cfg), looped = _presets(args)
    policy = args.policy
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-6))
    why_not = "--no-tunix" if args.no_tunix else tunix_ref.unavailable()
    info = {
        "target": "iteration",
        "platform": f"{platform.machine()} {jax.default_backend()}, {os.cpu_count()} cores, "
                    f"{jax.devices()[0].device_kind}",
        "jax": jax.__version__, "loadavg_start": round(os.getloadavg()[0], 2),
        "policy": str(policy), "batch": args.batch, "group": args.group,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "mu": 1,
        "minibatches": mbs, "loss": {"epsilon": LOSS.epsilon, "aggregation": LOSS.aggregation},
        "optimizer": "clip_by_global_norm(1.0) + adam(1e-6)", "sampling": "temperature 1.0",
        "draws": draws, "decode_layouts": layouts,
        "invariant_tiles": args.invariant_tiles or None,
        "tunix": {"available": why_not is None},
    }
    if why_not is None:
        info["tunix"]["version"] = tunix_ref.tunix_version()
    else:
        info["tunix"]["reason"] = why_not
    rows = args.batch * (args.prompt_len + args.new_tokens)
    before = None if args.no_roofline else measure_machine(dense_cfg, args.batch, rows)
    races = {}
    with tempfile.TemporaryDirectory() as tmp:
        races[dense_name] = dense_cfg, _preset_race(
            dense_cfg, policy, args, mbs, methods, draws, layouts, optimizer,
            tunix_ckpt=tmp if why_not is None else None)
    if looped is not None:
        name, cfg = looped
        races[name] = cfg, _preset_race(
            cfg, policy, args, mbs, methods, draws, layouts, optimizer)
    if not args.no_roofline:
        info["machine"] = best_machine(before, measure_machine(dense_cfg, args.batch, rows))
    for name, (cfg, (res, ours)) in races.items():
        if not args.no_roofline:
            add_bounds(res, ours, cfg, args.new_tokens, mbs, info["machine"])
        info[name] = res
    checks = {}
    dense = info[dense_name]
    for k in mbs:
        for m in ("hybrid", "products"):
            if "vs_tunix" in dense.get(f"{m}_mb{k}", {}):
                checks[f"{m}_mb{k}_vs_tunix>={TARGET_VS_TUNIX}"] = (
                    dense[f"{m}_mb{k}"]["vs_tunix"] >= TARGET_VS_TUNIX)
    info["loadavg_end"] = round(os.getloadavg()[0], 2)
    return {**info, "targets_met": checks}
