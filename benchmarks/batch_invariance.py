"""What gives a row other bits by the rows computed beside it on this XLA:CPU, and what the
batch-invariant forms (`numerics.invariant`) cost.

    python benchmarks/batch_invariance.py --out docs/bench/batch-invariance-2core-zen4.json

Three parts (`--parts`), one JSON object:

- `ops`: each operation of a decode step, compiled alone, at a decode's rows against a
  parallel forward's: the plain product `x @ W` (small-preset widths) by row count
  against 8, 32 and 1024 rows, the same with the weight read `[out, in]` (`x @ W.T`, the
  `transposed` layout's read) against the plain product of as many rows and of 1024,
  and the `W @ x.T` form by row count, unpadded and padded to the column tile
  (`invariant.column_tile`, the weights-major form's); reductions by row count against 2560 rows, with
  XLA's default YNNPACK fusions and with dots only
  (`invariant.COMPILER_OPTIONS`); attention, one query against all of a parallel
  forward's over the same cache slots, plain and invariant; fused multiply-add
  contraction (`a * b + c * d` against the separately rounded sum); a norm with a
  transposed product fused into its reduction, summed by XLA and as a fixed tree. Each
  entry counts the f32 values whose bits differ.
- `model`: a sampler in the `invariant` decode layout against the learner's `invariant`
  program (hidden 512, 2 layers, vocabulary 2048, 8 rows of up to 24 new tokens,
  temperature 0.8, EOS in play): the tokens whose log-prob differs, whole batch and 2-
  and 4-way slices, dense and looped deferred, f32 and bf16; then, dense f32, each form
  reverted to the plain one in a process of its own (`--ablation`): the learner's weight
  products plain (`product`), every product of all its rows at once instead of by chunks
  (`chunks`), XLA's default fusions (`options`), `apart`, `total`, the attention.
- `cost`: the small preset (8 rows, 16 + 112 tokens, f32): the sampler in the
  `transposed` layout (the default on CPU) against `invariant` in this CPU's form
  (`invariant.form_for`, recorded) and, where that form is weights-major, in the row
  chunks and, where it pads to half a column tile, in whole tiles, and one learner forward
  of a 2-row minibatch, `dense` (packed) against `invariant` (packed) in the same forms,
  alternating, the fastest of `--repeats`.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxrl_lp  # noqa: F401 - its XLA flag before the first computation

sys.path.insert(0, os.path.dirname(__file__))
from _xla_ops import emit  # noqa: E402

OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
HIGHEST = jax.lax.Precision.HIGHEST
ABLATIONS = ("none", "product", "chunks", "options", "apart", "total", "attention")


def _differ(a, b) -> int:
    return int((np.asarray(a, np.float32).view(np.uint32)
                != np.asarray(b, np.float32).view(np.uint32)).sum())


def _ops(quick: bool) -> dict:
    from jaxrl_lp.numerics.invariant import column_residues, column_tile, padded_rows

    rng = np.random.default_rng(0)
    out = {}
    plain = jax.jit(lambda x, w: jnp.dot(x, w, precision=HIGHEST), compiler_options=OPTIONS)
    out_in = jax.jit(lambda x, wt: jax.lax.dot_general(x, wt, (((1,), (1,)), ((), ())),
                                                       precision=HIGHEST),
                     compiler_options=OPTIONS)
    cols = jax.jit(lambda x, w: jax.lax.dot_general(w, x, (((1,), (1,)), ((), ())),
                                                    precision=HIGHEST).T,
                   compiler_options=OPTIONS)
    shapes = [(512, 1408)] if quick else [(512, 1408), (1408, 512), (512, 32000)]
    rows = [1, 2, 8, 16, 32, 33, 40, 64, 1024]
    tile = column_tile()
    out["column_tile"], out["column_residues"] = tile, list(column_residues())
    for k, n in shapes:
        x = rng.standard_normal((1024, k)).astype(np.float32)
        w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
        at8, at32, at1024 = (np.asarray(plain(x[:m], w)) for m in (8, 32, 1024))
        out[f"x@W K={k} N={n}: rows' bits vs 8 rows / vs 32 rows / vs 1024 rows"] = {
            m: [_differ(plain(x[:m], w)[:min(m, 8)], at8[:min(m, 8)]),
                _differ(plain(x[:m], w)[:min(m, 32)], at32[:min(m, 32)]),
                _differ(plain(x[:m], w), at1024[:m])] for m in rows}
        wt = np.ascontiguousarray(w.T)
        out[f"x@W.T ([out, in] read) K={k} N={n}: values differing from x@W, by rows"] = {
            m: _differ(out_in(x[:m], wt), plain(x[:m], w)) for m in (1, 2, 8, 32, 33, 64)}
        # A decode reading the transposed copy against a parallel forward's plain product.
        out[f"x@W.T ([out, in] read) K={k} N={n}: values differing from x@W of 1024 rows, "
            "by rows"] = {m: _differ(out_in(x[:m], wt), at1024[:m])
                          for m in (1, 2, 8, 32, 33, 64, 1024)}
        ref = np.asarray(cols(x, wt))
        counts = [*range(1, 18), 24, 25, 32, 40, 48, 64, 200, 256]
        out[f"W@x.T K={k} N={n}: row counts whose rows differ from 1024 rows'"] = [
            c for c in counts if _differ(cols(x[:c], wt), ref[:c])]
        for r in column_residues():  # the weights-major form: rows padded to the residue
            whole = padded_rows(1000, tile, r)
            want = np.asarray(cols(x[:whole], wt))
            padded = lambda m, x=x, wt=wt, r=r: cols(
                np.pad(x[:m], ((0, padded_rows(m, tile, r) - m), (0, 0))), wt)[:m]
            out[f"W@x.T K={k} N={n}, padded to {r} rows over whole column tiles ({tile}): "
                f"row counts whose rows differ from {whole} rows'"] = [
                    c for c in counts if _differ(padded(c), want[:c])]
    reductions = {"sum": lambda s: jnp.sum(s, -1),
                  "log_softmax": lambda s: jax.nn.log_softmax(s, -1),
                  "rms": lambda s: s * jax.lax.rsqrt(jnp.mean(s * s, -1, keepdims=True) + 1e-6)}
    for label, opts in (("ynn default", {}), ("dots only", OPTIONS)):
        table = {}
        for size in ([48, 512] if quick else [16, 48, 64, 128, 512, 4096, 32000]):
            x = (rng.standard_normal((2560, size)) * 3).astype(np.float32)
            for name, fn in reductions.items():
                f = jax.jit(fn, compiler_options=opts)
                ref = np.asarray(f(x))
                table[f"{name} over {size}"] = [r for r in (1, 2, 4, 7, 8, 16, 64)
                                                if _differ(f(x[:r]), ref[:r])]
        out[f"reductions, {label}: row counts whose rows differ from 2560 rows'"] = table
    out["attention: values differing, one query vs all over the same cache"] = _attention(quick)
    a, b, c, d = (rng.standard_normal(100000).astype(np.float32) for _ in range(4))
    y = np.asarray(jax.jit(lambda a, b, c, d: a * b + c * d, compiler_options=OPTIONS)(a, b, c, d))
    out["a*b + c*d: values differing from the separately rounded sum (FMA contraction)"] = \
        _differ(y, a * b + c * d)
    out["norm of h + a product (hidden 32), one row vs 32: values differing"] = _fused_norm()
    return out


def _attention(quick: bool) -> dict:
    from jaxrl_lp.models.attention import attention
    from jaxrl_lp.numerics.invariant import form_for, invariant_forms, opaque_zero
    from jaxrl_lp.numerics.policy import Policy

    policy = Policy.parse("fp32")
    rng = np.random.default_rng(1)
    out = {}
    for b, h, kv, dh, s in ([(2, 4, 2, 128, 520)] if quick else
                            [(8, 8, 4, 64, 240), (4, 16, 8, 128, 520)]):
        q = rng.standard_normal((b, s, h, dh)).astype(np.float32)
        k, v = (rng.standard_normal((b, kv, s, dh)).astype(np.float32) for _ in range(2))
        pos = np.broadcast_to(np.arange(s, dtype=np.int32)[None], (b, s))
        for label, opts, inv in (("plain", {}, False), ("plain, dots only", OPTIONS, False),
                                 ("invariant", OPTIONS, True)):
            def run(q, p, inv=inv, b=b, k=k, v=v, pos=pos):
                with invariant_forms(opaque_zero(jnp.int32(0)), form_for(b) if inv else None):
                    return attention(q, k, v, p, pos, policy)
            f = jax.jit(run, compiler_options=opts)
            every = np.asarray(f(q, pos))
            ts = range(0, s, max(1, s // 8))
            out[f"B{b} H{h} K{kv} Dh{dh} S{s} {label}"] = sum(
                _differ(f(q[:, t:t + 1], pos[:, t:t + 1])[:, 0], every[:, t]) for t in ts)
    return out


def _fused_norm() -> dict:
    from jaxrl_lp.numerics.invariant import form_for, invariant_forms, opaque_zero, total, weights_product

    rng = np.random.default_rng(2)
    h = rng.standard_normal((8, 32, 32)).astype(np.float32)
    u = rng.standard_normal((8, 32, 64)).astype(np.float32)
    w = (rng.standard_normal((64, 32)) * 0.1).astype(np.float32)
    out = {}
    for label, tree in (("XLA's reduction", False), ("fixed tree (invariant.total)", True)):
        def norm(h, u, v, tree=tree):
            with invariant_forms(opaque_zero(v), form_for(8)):
                x = h + weights_product(u.reshape(-1, 64), w).reshape(*u.shape[:-1], 32)
                ss = total(x * x) if tree else jnp.sum(x * x, -1, keepdims=True)
                return x / jnp.sqrt(ss / 32 + 1e-6)
        f = jax.jit(norm, compiler_options=OPTIONS)
        every = f(h, u, jnp.int32(1))
        out[label] = sum(_differ(f(h[:, t:t + 1], u[:, t:t + 1], jnp.int32(1)), every[:, t:t + 1])
                         for t in range(32))
    return out


def _sampled(kind: str, policy_name: str):
    """The model part's model and its rollout in the `invariant` decode layout:
    `(cfg, policy, params, rollout, loop)`."""
    from jaxrl_lp.models.config import get_preset
    from jaxrl_lp.models.model import init_params
    from jaxrl_lp.numerics.policy import Policy
    from jaxrl_lp.rollout.generate import generate
    from jaxrl_lp.rollout.sampling import SamplingConfig
    from jaxrl_lp.rollout.step import LoopSpec

    policy = Policy.parse(policy_name)
    cfg = get_preset("small-qwen3").replace(num_layers=2, vocab_size=2048)
    loop = LoopSpec()
    if kind == "looped_deferred":
        cfg = cfg.replace(family="ouro", loop_steps=3, qk_norm=False)
        loop = LoopSpec("threshold:0.5", "deferred")
    params = init_params(cfg, jax.random.PRNGKey(0))
    params["lm_head"] = params["lm_head"].at[:, 3].multiply(6.0)
    if cfg.is_looped:
        params["exit_gate"] = {"kernel": params["exit_gate"]["kernel"] * 20.0,
                               "bias": params["exit_gate"]["bias"] + 2.0}
    ro = generate(params, cfg, [[1, 5, 7], [2, 9, 4, 11, 3, 8], [6], [12, 13, 14, 15]],
                  policy=policy, sampling=SamplingConfig(temperature=0.8), max_new_tokens=24,
                  num_samples=2, eos_id=3, loop=loop, key=jax.random.PRNGKey(1),
                  decode_layout="invariant")
    return cfg, policy, params, ro, loop


def _model_case(kind: str, policy_name: str, ablation: str) -> dict:
    """Sampler (invariant layout) against the learner's invariant program, with `ablation`
    (one form reverted to the plain one) applied in this process."""
    import jaxrl_lp.numerics.invariant as inv

    if ablation == "options":
        inv.COMPILER_OPTIONS.clear()  # before the programs below are jitted
    import jaxrl_lp.models.attention as att
    import jaxrl_lp.models.layers as layers
    from jaxrl_lp.rl.logprob_programs import jit_learner_logprobs
    from jaxrl_lp.rollout.generate import take_rows

    if ablation == "product":  # the learner's weight products plain (`x @ W`)
        inv.invariant_dot = lambda x, w, policy: layers._f32_product(x, w, policy)
    elif ablation == "chunks":  # every product of all its rows at once
        inv._by_rows = lambda fn, x, chunk: fn(x)
    elif ablation == "apart":  # products and sums left to fuse into multiply-adds
        inv.apart = lambda x: x
    elif ablation == "total":  # XLA's reductions
        inv.total = lambda x, axis=-1: jnp.sum(x, axis=axis, keepdims=True)
    elif ablation == "attention":  # the attention's plain products
        att._invariant_attention = lambda q, k, v, qp, kp, p: att._attention(q, k, v, qp, kp,
                                                                              p, False)
    cfg, policy, params, ro, _ = _sampled(kind, policy_name)
    program = jit_learner_logprobs(cfg, policy, "invariant")
    mask = np.asarray(ro.completion_mask) > 0
    out = {"tokens": int(mask.sum())}
    for ways in (1, 2, 4):
        size = 8 // ways
        got = np.concatenate([np.asarray(program(params, take_rows(ro, np.arange(i, i + size))))
                              for i in range(0, 8, size)])
        out[f"differing_{ways}_way"] = _differ(got[mask], np.asarray(ro.logprobs)[mask])
    return out


def _model(quick: bool) -> dict:
    out = {}
    cases = [("dense", "fp32")] if quick else [
        (k, p) for k in ("dense", "looped_deferred") for p in ("fp32", "bf16")]
    for kind, pol in cases:
        out[f"{kind} {pol}"] = _model_case(kind, pol, "none")
    out["ablations (dense fp32, one form reverted, a process each)"] = {
        a: _subprocess_case("dense", "fp32", a) for a in (ABLATIONS[1:2] if quick else ABLATIONS[1:])}
    return out


def _subprocess_case(kind, pol, ablation) -> dict:
    res = subprocess.run([sys.executable, __file__, "--ablation", ablation, "--kind", kind,
                          "--policy", pol], capture_output=True, text=True, check=True)
    return json.loads(res.stdout)


def _cost(repeats: int, quick: bool) -> dict:
    from jaxrl_lp.models.config import get_preset
    from jaxrl_lp.models.model import init_params
    from jaxrl_lp.numerics.invariant import form_for
    from jaxrl_lp.numerics.policy import Policy
    from jaxrl_lp.rl.logprob_programs import jit_learner_logprobs
    from jaxrl_lp.rollout.generate import generate, take_rows
    from jaxrl_lp.rollout.sampling import SamplingConfig

    policy = Policy.parse("fp32")
    cfg = get_preset("tiny-qwen3" if quick else "small-qwen3")
    params = init_params(cfg, jax.random.PRNGKey(0))
    prompts = np.random.RandomState(0).randint(3, cfg.vocab_size, (2, 16)).tolist()
    new = 16 if quick else 112

    form = form_for(8)
    # Each sampler: (decode layout, invariant form); the row chunks beside a weights-major form.
    samplers = {"transposed": ("transposed", None), "invariant": ("invariant", form)}
    if form.columns is not None:
        samplers["invariant_row_chunks"] = ("invariant", form._replace(columns=None, residue=0))
    if form.residue:  # the same weights-major form padding to whole tiles
        samplers["invariant_whole_tiles"] = ("invariant", form._replace(residue=0))

    def sample(name, i=0):
        layout, f = samplers[name]
        return jax.block_until_ready(generate(
            params, cfg, prompts, policy=policy, sampling=SamplingConfig(temperature=1.0),
            max_new_tokens=new, num_samples=4, eos_id=None, key=jax.random.PRNGKey(i),
            decode_layout=layout, invariant_form=f))

    rollouts = {name: sample(name) for name in samplers}
    programs = {"dense": jit_learner_logprobs(cfg, policy, "dense"),
                **{name: jit_learner_logprobs(cfg, policy, "invariant")
                   for name in samplers if name != "transposed"}}
    minibatch = {m: take_rows(rollouts["transposed" if m == "dense" else m], np.arange(2))
                 for m in programs}
    calls = {f"sampler_{name}_s": (lambda name=name: sample(name, 1)) for name in rollouts}
    calls.update({f"forward_2_rows_{m}_s": (lambda m=m: jax.block_until_ready(
        programs[m](params, minibatch[m]))) for m in programs})
    for fn in calls.values():
        fn()
    times = {k: [] for k in calls}
    for _ in range(repeats):
        for k, fn in calls.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    out = {k: round(min(v), 4) for k, v in times.items()}
    out["sampler_invariant_over_transposed"] = round(
        out["sampler_invariant_s"] / out["sampler_transposed_s"], 3)
    out["forward_invariant_over_dense"] = round(
        out["forward_2_rows_invariant_s"] / out["forward_2_rows_dense_s"], 3)
    for other in ("row_chunks", "whole_tiles"):
        if f"sampler_invariant_{other}_s" in out:
            out[f"sampler_{other}_over_transposed"] = round(
                out[f"sampler_invariant_{other}_s"] / out["sampler_transposed_s"], 3)
            out[f"forward_{other}_over_dense"] = round(
                out[f"forward_2_rows_invariant_{other}_s"] / out["forward_2_rows_dense_s"], 3)
    out.update(preset="tiny-qwen3" if quick else "small-qwen3", rows=8, prompt_len=16,
               new_tokens=new, repeats=repeats, form=form._asdict())
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="ops,model,cost")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="the smallest sizes (the test's)")
    ap.add_argument("--out", help="also write the JSON to this file")
    ap.add_argument("--ablation", choices=ABLATIONS, help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="dense", help=argparse.SUPPRESS)
    ap.add_argument("--policy", default="fp32", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ablation:  # one case in this process (`_subprocess_case`)
        print(json.dumps(_model_case(args.kind, args.policy, args.ablation)))
        return
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    result = {"script": "benchmarks/batch_invariance.py", "date": time.strftime("%Y-%m-%d"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {_cpu_name()}",
              "jax": jax.__version__, "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    if "ops" in parts:
        result["ops"] = _ops(args.quick)
    if "model" in parts:
        result["model"] = _model(args.quick)
    if "cost" in parts:
        result["cost"] = _cost(args.repeats, args.quick)
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    emit(result, args.out)


if __name__ == "__main__":
    main()
