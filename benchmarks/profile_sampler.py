"""Where the sampler's rollout of a preset spends its time, by XLA op (jax.profiler).

    python benchmarks/profile_sampler.py [--size small] [--draw gumbel] [--calls 2] > out.json
    python benchmarks/profile_sampler.py --size qwen3-0.6b --policy bf16 --prompts 8 \
        --prompt-len 128 --new-tokens 256 --calls 1      # benchmarks/gpu.sh SUITE=profile

By default the rollout `jaxrl-lp bench iteration` samples on CPU (`rollout.generate`:
2 prompts of 16 tokens, 4 samples each, 112 new tokens, no EOS, f32, temperature 1)
with random weights; `--size` takes `tiny`, `small` or any preset name, and `--policy`,
`--prompts`, `--prompt-len` and `--new-tokens` set the rest (4 samples a prompt).
After two warm-up calls and `--repeats` timed ones,
`--calls` run under `jax.profiler.trace`; the trace's XLA op events are summed
per op and divided by the calls. Each op is named by its HLO `op_name`, read
from the optimized HLO that XLA dumps while this script compiles (a temporary
`--xla_dump_to`, removed at the end). The weight matmuls are the ops of
`layers.dot`'s product (`op_name` ending `...k,kn->...n/dot_general`, or in the
`transposed` decode layout `weights_major/dot_general`): their
share of the op time is `weight_matmul_share`; `other_dot_s` is the rest of
the dots (attention's). Prints one JSON object.

On XLA:CPU the executor may run independent ops on its threads at once, and
the profiler slows the rollout: read the figures as shares of the op time. On a
GPU the ops are the device's (its `XLA Ops` line); `trace` says which lines the
ops were read from, or what the trace held where no event matched.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import tempfile
import time

DUMP = tempfile.mkdtemp(prefix="profile_sampler_hlo_")
# Before jax is imported: XLA reads its flags once.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text").strip()

import jax  # noqa: E402

# Op names come from XLA's dump of what it compiles: an executable from a persistent
# compilation cache (a caller's JAX_COMPILATION_CACHE_DIR) is not compiled, and carries
# the op names of the program that filled the cache.
jax.config.update("jax_enable_compilation_cache", False)
from _xla_ops import emit, op_names, op_times  # noqa: E402

# The op names of `layers.dot`'s weight products: as stored, and in the transposed layout.
WEIGHT_PRODUCTS = ("...k,kn->...n/dot_general", "weights_major/dot_general")


def _dumped_op_names(dump_dir: str) -> dict[str, str]:
    """`op_names` over every optimized module XLA dumped."""
    out = {}
    for path in sorted(glob.glob(f"{dump_dir}/*after_optimizations.txt")):
        with open(path) as f:
            out = {**op_names(f.read()), **out}
    return out


def main() -> tuple[dict, str | None]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", help="tiny, small or a preset name")
    ap.add_argument("--policy", default="fp32")
    ap.add_argument("--draw", default="gumbel", choices=["gumbel", "inverse_cdf"])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=112)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--record-products", action="store_true",
                    help="the rollout keeps its weight products and logits "
                         "(`grpo.reuse_products`, the iteration bench's `products`)")
    ap.add_argument("--decode-layout", default=None,
                    choices=["as_stored", "transposed", "invariant"],
                    help="the sampler's decode layout (default: generate's pick)")
    ap.add_argument("--out", help="also write the JSON to this file")
    args = ap.parse_args()

    import numpy as np

    from jaxrl_lp.bench.learner import SIZES
    from jaxrl_lp.models.config import get_preset
    from jaxrl_lp.models.model import init_params
    from jaxrl_lp.numerics.policy import Policy
    from jaxrl_lp.rollout import SamplingConfig, generate

    preset = SIZES.get(args.size, args.size)
    cfg, policy = get_preset(preset), Policy.parse(args.policy)
    params = init_params(cfg, jax.random.PRNGKey(1))
    prompts = np.random.default_rng(0).integers(1, cfg.vocab_size,
                                                (args.prompts, args.prompt_len)).tolist()
    sampling = SamplingConfig(temperature=1.0, draw=args.draw)

    def call():
        ro = generate(params, cfg, prompts, policy=policy, sampling=sampling,
                      max_new_tokens=args.new_tokens, num_samples=4, eos_id=None,
                      key=jax.random.PRNGKey(3),
                      record_products=args.record_products, decode_layout=args.decode_layout)
        return jax.block_until_ready(ro.completion_tokens)

    call()
    call()
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    names = _dumped_op_names(DUMP)
    seconds, total, count, trace = op_times(call, args.calls, names)
    ops = sum(total.values())
    shutil.rmtree(DUMP, ignore_errors=True)
    weights = sum(s for name, s in total.items()
                  if names[name].endswith(WEIGHT_PRODUCTS))
    dots = sum(s for name, s in total.items() if names[name].endswith("dot_general"))
    result = {"preset": preset, "policy": str(policy), "device": jax.devices()[0].device_kind,
             "draw": args.draw, "record_products": args.record_products,
             "decode_layout": args.decode_layout or "auto",
             "batch": 4 * args.prompts, "prompt_len": args.prompt_len,
             "new_tokens": args.new_tokens, "calls": args.calls,
             "loadavg": [round(x, 2) for x in os.getloadavg()],
             "rollout_s": round(min(times), 3), "rollout_s_under_profiler": round(seconds, 3),
             # Six decimals: the tiny preset's whole rollout is milliseconds of ops.
             "ops_s": round(ops, 6), "weight_matmul_s": round(weights, 6),
             "weight_matmul_share": round(weights / ops, 4) if ops else 0.0,
             "other_dot_s": round(dots - weights, 6), "trace": trace,
             "top": [{"op": name, "s": round(s, 4), "share": round(s / ops, 4),
                      "calls": count[name], "op_name": names[name][-160:]}
                     for name, s in total.most_common(args.top)]}
    return result, args.out


if __name__ == "__main__":
    emit(*main())
