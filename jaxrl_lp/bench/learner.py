"""The learner benchmark: our GRPO step (dense and hybrid log-probs) against Tunix's GRPO update.

A random dense preset (`small`: `small-qwen3`, 8 layers, hidden 512, vocab
32000; or any model preset by name, `qwen3-0.6b` on a GPU) is saved as a
Hugging Face checkpoint (`save_hf_checkpoint`, f32) for Tunix.
`--looped` takes the preset's shapes as an Ouro-style looped model instead
(`bench.sampler.LOOPED_SIZES`, R = 4 loop steps, read out at the last:
`full/dense`), ours only (Tunix has no looped model). One
fixed GRPO batch: B sequences of `--seq-len` tokens (`--prompt-len` prompt +
the rest completion; random tokens, completions of random lengths from half to
all of the completion, right-padded), groups of `--group` with advantages from
random rewards (`group_advantages`), and old log-probs our learner's own at
these weights. Timed, alternately after a warm-up so a change in load falls
on all (`bench.sampler._race`, the fastest run reported):

- `hybrid-recorded`: the hybrid step given the rollout's log-probs as its
  value (`replay_BxN`), what the training program runs where an update
  computes with the sampler's weights (`grpo.replay=auto`: the first update
  at mu = 1; `train.behaviour`). The weights move by 1e-6 a call here, so
  after the first the values are the recorded ones only in kind; the time is
  the same. Its target: at most 1.05x the dense step.
- `dense`, `hybrid`: our jitted step (`make_grpo_step`, PPO-clip epsilon 0.2,
  `seq_mean_token_mean`, one micro-batch) under `--policy`. It skips the
  padding (`models.packing`: the real tokens in `--pack-buckets` sizes of
  packed rows; `packed_rows` in the JSON); `--pack-buckets 0` computes every
  slot, as Tunix does, and `dense-unpacked` / `hybrid-unpacked` in
  `--methods` race that step beside the packed one;
- `tunix`: Tunix's GRPO update on the same checkpoint, tokens, masks,
  advantages and old log-probs (`bench.tunix_ref`: its Qwen3 loader, its RL
  trainer's jitted step, its `grpo` loss), when `google-tunix` imports (the
  `bench` extra); otherwise the JSON says why and reports ours only.

Both sides use the same optax transformation (global-norm clip 1.0, Adam
1e-6). Tokens/s counts all B x T tokens of the batch. `model_tflops_per_s`
and `mfu` count model FLOPs per token as 6 x (matmul parameters: the
layers' projections and the lm head, not the embedding gather) + 12 x L x
(H x head_dim) x T (attention scores and values, forward and backward,
PaLM's count, the causal half not discounted): a hybrid step's replay is
overhead, not model FLOPs. The peak is the accelerator's dense bf16 figure
(`plan.targets`, by device name) on GPU/TPU and the development CPUs' f32 matmul
rate on CPU (`CPU_PEAK_FLOPS`, measured: docs/design/low_precision.md, "Performance
on the development CPUs"), or `--peak-tflops`. For our steps the JSON adds
the compiled program's own figures: `compiled_flops` (its dots, each loop body
times its trip count: `plan.hlo_cost`) and `compiled_temp_bytes` (its
temporaries, `plan.roofline.memory_figures`). Taking them after the timed runs
costs no compile (the program is in jit's cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_lp.bench import tunix_ref
from jaxrl_lp.bench.sampler import LOOPED_SIZES, _race  # the one alternating race
from jaxrl_lp.models.config import ModelConfig, get_preset
from jaxrl_lp.models.hf_io import save_hf_checkpoint
from jaxrl_lp.models.model import init_params
from jaxrl_lp.numerics.policy import Policy, policy_arg
from jaxrl_lp.plan.hlo_cost import hlo_cost
from jaxrl_lp.plan.roofline import memory_figures
from jaxrl_lp.rl.advantages import group_advantages
from jaxrl_lp.rl.logprob_programs import jit_learner_logprobs
from jaxrl_lp.rl.logprobs import packed_rows_of
from jaxrl_lp.rl.loss import LossConfig
from jaxrl_lp.rl.train_step import make_grpo_step
from jaxrl_lp.rollout.generate import Rollout
from jaxrl_lp.rollout.step import LoopSpec, decode_layout

__all__ = ["SIZES", "add_arguments", "grpo_batch", "model_flops_per_token", "peak_flops", "run"]

SIZES = {"tiny": "tiny-qwen3", "small": "small-qwen3"}
PAD_ID, EOS_ID = 0, 2  # random tokens are drawn from [3, V): no pad or EOS inside a sequence
CPU_PEAK_FLOPS = 190e9  # f32 matmul on the development CPUs (docs/design/low_precision.md)
LOSS = LossConfig(epsilon=0.2, aggregation="seq_mean_token_mean")
TARGET_VS_TUNIX, TARGET_HYBRID_OVER_DENSE, TARGET_RECORDED_OVER_DENSE = 1.2, 1.5, 1.05


def grpo_batch(cfg: ModelConfig, policy: Policy, params: dict, *, batch: int, prompt_len: int,
               seq_len: int, group: int, seed: int) -> tuple[Rollout, jax.Array]:
    """A fixed GRPO minibatch: a rollout of random tokens and its advantages [B].

    A looped model's rollout is read at the model's own exit rule in dense
    mode, every token at the last loop step (its `full` rule), and the replay
    decodes in the layout `generate` would sample these weights in.
    """
    rng = np.random.RandomState(seed)
    n = seq_len - prompt_len
    lengths = rng.randint(max(1, n // 2), n + 1, batch)
    lengths[0] = n  # at least one sequence runs to the end
    mask = np.arange(n)[None] < lengths[:, None]
    completion = np.where(mask, rng.randint(3, cfg.vocab_size, (batch, n)), PAD_ID)
    zeros = jnp.zeros((batch, n), jnp.float32)
    ro = Rollout(prompt_tokens=jnp.asarray(rng.randint(3, cfg.vocab_size, (batch, prompt_len)),
                                           jnp.int32),
                 prompt_lengths=jnp.full((batch,), prompt_len, jnp.int32),
                 completion_tokens=jnp.asarray(completion, jnp.int32),
                 completion_mask=jnp.asarray(mask, jnp.float32), logprobs=zeros,
                 exit_steps=jnp.full((batch, n), cfg.loop_steps - 1 if cfg.is_looped else 0,
                                     jnp.int32),
                 loop_evals=jnp.int32(0), weights_version=jnp.int32(0), policy=policy,
                 loop=LoopSpec().resolve(cfg), decode_layout=decode_layout(params, policy))
    # The sampler's log-probs stand in as the learner's own at these weights (what an
    # on-policy rollout records up to kernel rounding).
    logp = jit_learner_logprobs(cfg, policy, "dense")(params, ro) * ro.completion_mask
    adv = group_advantages(jnp.asarray(rng.rand(batch), jnp.float32), group)
    return dataclasses.replace(ro, logprobs=logp), adv


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) model FLOPs per token; see the module docstring.

    A looped model applies its layers once per loop step.
    """
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    layers = cfg.num_layers * (cfg.loop_steps if cfg.is_looped else 1)
    per_layer = d * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * d * f
    matmul_params = layers * per_layer + d * cfg.vocab_size
    return 6.0 * matmul_params + 12.0 * layers * cfg.num_heads * hd * seq_len


def peak_flops(override_tflops: float | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s, where it comes from) of the default device."""
    from jaxrl_lp.plan.targets import target_of_device

    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return CPU_PEAK_FLOPS, "f32 matmul on the development CPUs (docs/design/low_precision.md)"
    t = target_of_device(dev.device_kind)
    if t is None:
        return None, f"no peak known for {dev.device_kind}; pass --peak-tflops"
    return t.peak_flops, f"plan.targets[{t.name!r}] (dense bf16) for {dev.device_kind}"


def _keep_first(fn):
    """`fn` wrapped so that the result of its first call is kept (`.first`)."""
    def call():
        out = fn()
        if not hasattr(call, "first"):
            call.first = out
        return out
    return call


def _ours(cfg, policy, params, ro, adv, optimizer, method, pack_buckets, recorded=False):
    step = make_grpo_step(cfg, policy, LOSS, optimizer, method=method, pack_buckets=pack_buckets)
    state = {"params": jax.tree.map(jnp.copy, params), "opt": optimizer.init(params)}
    # `recorded`: the hybrid's value handed in (the rollout's log-probs), as the training
    # program does where the update's weights are the sampler's; no replay runs.
    args = (ro, adv, ro.logprobs, None, None, ro.logprobs if recorded else None)

    def call():
        state["params"], state["opt"], m = step(state["params"], state["opt"], *args)
        return jax.block_until_ready({"loss": m["loss"], "grad_norm": m["grad_norm"]})
    return _keep_first(call), lambda: _compiled_figures(
        step.lower(state["params"], state["opt"], *args).compile())


def _compiled_figures(compiled) -> dict:
    """The compiled step's dot FLOPs (loop-aware, `plan.hlo_cost`) and temporary bytes."""
    return {"compiled_flops": hlo_cost(compiled.as_text()).flops,
            "compiled_temp_bytes": memory_figures(compiled)["temp"]}


def _tunix(cfg, policy, params, ro, adv, optimizer, group, ckpt):
    save_hf_checkpoint(ckpt, cfg, params, dtype="f32")
    step, model = tunix_ref.tunix_update(
        ckpt, cfg, optimizer, compute_dtype=policy.compute_dtype, aggregation=LOSS.aggregation,
        epsilon=LOSS.epsilon, num_generations=group, pad_id=PAD_ID, eos_id=EOS_ID)
    example = tunix_ref.tunix_train_example(ro, adv, ro.logprobs)
    agree = tunix_ref.weights_agree(model, cfg, params)

    def call():
        loss, _, grad_norm = step(example)
        return jax.block_until_ready({"loss": loss, "grad_norm": grad_norm})
    return _keep_first(call), agree


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `jaxrl-lp bench learner`."""
    parser.add_argument("--size", default="small",
                        help="small (small-qwen3: 8 layers, hidden 512, vocab 32000), tiny "
                             "(tiny-qwen3), or a model preset (qwen3-0.6b; with --looped, a "
                             "looped one: ouro-1.4b)")
    parser.add_argument("--looped", action="store_true",
                        help="the preset's shapes as a looped model (R = 4), ours only")
    parser.add_argument("--batch", type=int, default=8, help="sequences B")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens T (prompt + completion)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--group", type=int, default=4, help="GRPO group size G (divides B)")
    parser.add_argument("--policy", default="fp32", type=policy_arg,
                        help="precision policy of our step; Tunix gets its compute dtype")
    parser.add_argument("--methods", default="dense,hybrid,hybrid-recorded",
                        help="our steps to time: dense, hybrid (the replay runs: a later "
                             "minibatch, grpo.replay=always), hybrid-recorded (the value is the "
                             "rollout's: the first update at mu = 1), and dense or hybrid with "
                             "'-unpacked' (every slot computed, as with --pack-buckets 0; "
                             "hybrid-recorded-unpacked too)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs of each after warm-up (at least; see --min-time)")
    parser.add_argument("--min-time", type=float, default=3.0,
                        help="keep alternating until each took about this many seconds")
    parser.add_argument("--pack-buckets", type=int, default=16,
                        help="our step skips the padding, in this many packed sizes "
                             "(make_grpo_step's pack_buckets); 0 computes every slot")
    parser.add_argument("--no-tunix", action="store_true", help="skip the Tunix reference")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak FLOP/s for the MFU (default: by device, module docstring)")
    parser.add_argument("--ckpt-dir", default=None, help="where to save the HF checkpoint "
                        "(default: a temporary directory)")
    parser.add_argument("--seed", type=int, default=0)


def _model(size: str, looped: bool) -> ModelConfig:
    """`--size` (with `--looped`) as a model config; a preset of the wrong kind is an error."""
    if size in SIZES:
        return LOOPED_SIZES[size] if looped else get_preset(SIZES[size])
    cfg = get_preset(size)
    if cfg.is_looped != looped:
        raise ValueError(f"--size {size!r} is a {'looped' if cfg.is_looped else 'dense'} preset; "
                         + ("add --looped" if cfg.is_looped else "drop --looped"))
    return cfg


def run(args: argparse.Namespace) -> dict:
    """Runs the benchmark; returns one JSON-serializable dict."""
    if not 0 < args.prompt_len < args.seq_len:
        raise ValueError("--prompt-len must be in [1, --seq-len)")
    if args.batch % args.group or args.group < 2:
        raise ValueError("--group must be >= 2 and divide --batch")
    if args.pack_buckets < 0:
        raise ValueError(f"--pack-buckets must be >= 0 (0: no packing); got {args.pack_buckets}")
    methods = [m for m in args.methods.split(",") if m]
    allowed = ("dense", "hybrid", "hybrid-recorded", "dense-unpacked", "hybrid-unpacked",
               "hybrid-recorded-unpacked")
    if bad := [m for m in methods if m not in allowed]:
        raise ValueError(f"--methods: unknown {bad}; allowed: {', '.join(allowed)}")
    cfg = _model(args.size, args.looped)
    policy = args.policy
    params = init_params(cfg, jax.random.PRNGKey(args.seed))
    ro, adv = grpo_batch(cfg, policy, params, batch=args.batch, prompt_len=args.prompt_len,
                         seq_len=args.seq_len, group=args.group, seed=args.seed)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-6))
    ours = {m: _ours(cfg, policy, params, ro, adv, optimizer,
                     m.removesuffix("-unpacked").removesuffix("-recorded"),
                     0 if m.endswith("-unpacked") else args.pack_buckets,
                     recorded="-recorded" in m)
            for m in methods}
    calls = {m: call for m, (call, _) in ours.items()}
    why_not = ("--no-tunix" if args.no_tunix else
               "--looped: Tunix has no looped model" if args.looped else tunix_ref.unavailable())
    info = {
        "target": "learner",
        "platform": f"{platform.machine()} {jax.default_backend()}, {os.cpu_count()} cores, "
                    f"{jax.devices()[0].device_kind}",
        "jax": jax.__version__, "loadavg_start": round(os.getloadavg()[0], 2),
        "preset": (SIZES[args.size] + f"-looped-r{cfg.loop_steps}"
                   if args.looped and args.size in SIZES else SIZES.get(args.size, args.size)),
        "params": cfg.param_count(), "policy": str(policy),
        "batch": args.batch, "seq_len": args.seq_len, "prompt_len": args.prompt_len,
        "completion_tokens": int(ro.completion_mask.sum()), "group": args.group,
        "pack_buckets": args.pack_buckets,
        # (body rows of B x T, head rows of B x N) our packed step computes
        "packed_rows": list(packed_rows_of(ro, buckets=args.pack_buckets))
        if args.pack_buckets else None,
        "loss": {"epsilon": LOSS.epsilon, "aggregation": LOSS.aggregation, "kl_beta": 0.0},
        "optimizer": "clip_by_global_norm(1.0) + adam(1e-6)",
        "tunix": {"available": why_not is None},
    }
    with tempfile.TemporaryDirectory() as tmp:
        if why_not is None:
            calls["tunix"], agree = _tunix(cfg, policy, params, ro, adv, optimizer, args.group,
                                           args.ckpt_dir or tmp)
            info["tunix"].update(version=tunix_ref.tunix_version(),
                                 embedding_max_abs_diff=agree)
        else:
            info["tunix"]["reason"] = why_not
        firsts, times, _ = _race(calls, args.repeats, args.min_time)
    tokens = args.batch * args.seq_len
    flops = model_flops_per_token(cfg, args.seq_len) * tokens
    peak, peak_src = peak_flops(args.peak_tflops)
    res = {}
    for m, fn in calls.items():
        best = min(times[m])
        res[m] = {"step_s": round(best, 4), "runs": len(times[m]),
                  "compile_s": round(firsts[m] - best, 2),
                  "tokens_per_s": round(tokens / best, 1),
                  "model_tflops_per_s": round(flops / best / 1e12, 4),
                  "loss_first": float(fn.first["loss"]),
                  "grad_norm_first": float(fn.first["grad_norm"])}
        if peak:
            res[m]["mfu"] = round(flops / best / peak, 4)
        if m in ours:
            res[m].update(ours[m][1]())
    if "tunix" in res:  # one entry: whether and which Tunix ran, and its timing
        res["tunix"] = {**info.pop("tunix"), **res["tunix"]}
    ratios, checks = {}, {}
    if "tunix" in res:
        for m in methods:
            ratios[f"{m}_vs_tunix"] = round(res[m]["tokens_per_s"] / res["tunix"]["tokens_per_s"], 3)
        if "dense" in res:
            checks[f"dense_vs_tunix>={TARGET_VS_TUNIX}"] = ratios["dense_vs_tunix"] >= TARGET_VS_TUNIX
            # Same weights, tokens, advantages and anchor: how far apart the two losses are
            # (both near 0 at ratio 1; Tunix's log-probs of the same tokens differ slightly).
            ratios["loss_abs_diff_dense_tunix"] = abs(res["dense"]["loss_first"]
                                                      - res["tunix"]["loss_first"])
    if "dense" in res and "hybrid" in res:
        ratios["hybrid_over_dense_time"] = round(res["hybrid"]["step_s"] / res["dense"]["step_s"], 3)
        checks[f"hybrid_over_dense_time<={TARGET_HYBRID_OVER_DENSE}"] = (
            ratios["hybrid_over_dense_time"] <= TARGET_HYBRID_OVER_DENSE)
    if "dense" in res and "hybrid-recorded" in res:
        ratios["hybrid_recorded_over_dense_time"] = round(
            res["hybrid-recorded"]["step_s"] / res["dense"]["step_s"], 3)
        checks[f"hybrid_recorded_over_dense_time<={TARGET_RECORDED_OVER_DENSE}"] = (
            ratios["hybrid_recorded_over_dense_time"] <= TARGET_RECORDED_OVER_DENSE)
    for m in ("dense", "hybrid", "hybrid-recorded"):  # what skipping the padding saves
        if m in res and f"{m}-unpacked" in res:
            ratios[f"{m}_packing_speedup"] = round(res[f"{m}-unpacked"]["step_s"]
                                                   / res[m]["step_s"], 3)
    info.update(model_flops_per_step=flops, peak_flops=peak, peak_source=peak_src,
                loadavg_end=round(os.getloadavg()[0], 2))
    return {**info, **ratios, "targets_met": checks, **res}
