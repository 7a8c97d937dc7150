"""The speculative replay by its sampler's own program: what it costs, and its exactness by slice.

    python benchmarks/speculative_replay.py > docs/bench/speculative-replay-2core-cpu.json

A self-speculative rollout (tiny Ouro, 4 loop steps, drafted at 1 with k = 2, 16 rows of
4 prompt + 32 new tokens, f32, temperature 0.8). Times, the median of `--repeats` calls
of each, the four alternating after two warm-ups:
- `sampler_forcing_input_s`: `speculative_program` as `speculative_generate` calls it
  (the replay's forcing input given, off);
- `sampler_without_s`: the same program compiled without that input (`forced=None`);
- `replay_program_s`: `rollout.replay.replay_logprobs`, the sampler's program with the
  recorded tokens, counts and exit steps forced (the drafter runs, its drafts replaced);
- `traced_replay_s`: `rollout.speculative.replay_speculative` jitted, the verification
  chunks traced into a program of their own (the former construction).
Then, per slice count (1, 2, 4), the completion tokens whose replayed log-prob differs
from the sampler's by each construction. Prints one JSON object.
"""

import argparse
import json
import platform
import time

import jax
import numpy as np

from jaxrl_lp.bench.exactness import exactness_model
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rollout.generate import call_inputs, one_device, take_rows
from jaxrl_lp.rollout.replay import replay_logprobs
from jaxrl_lp.rollout.request import check_request
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.rollout.spec_config import SpecConfig
from jaxrl_lp.rollout.speculative import (
    replay_speculative,
    speculative_generate,
    speculative_program,
)

SPEC, NEW_TOKENS, SAMPLES = "self:loops=1,k=2", 32, 2
PROMPTS = [[1 + i, 5, 7, 2 + i] for i in range(8)]


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    policy, sampling = Policy.parse("fp32"), SamplingConfig(temperature=0.8)
    cfg, params, loop = exactness_model("looped_dense", loop_steps=4)
    key = jax.random.PRNGKey(0)
    ro = speculative_generate(params, cfg, PROMPTS, SPEC, policy=policy, sampling=sampling,
                              loop=loop, max_new_tokens=NEW_TOKENS, num_samples=SAMPLES,
                              key=key)
    # The program's inputs as `speculative_generate` places them.
    req = check_request(PROMPTS, cfg, sampling=sampling, max_new_tokens=NEW_TOKENS,
                        num_samples=SAMPLES, eos_id=None, pad_id=0, key=key, draft_slots=2)
    zeros = np.zeros((len(PROMPTS) * SAMPLES, NEW_TOKENS), np.int32)
    inputs = call_inputs(req.tokens_BxP, req.positions_BxP, req.lengths_B, req.key, 0, zeros,
                         zeros, False, device=one_device(params), counts_BxN=zeros)
    kw = dict(cfg=cfg, dcfg=None, spec=SpecConfig.parse(SPEC).resolve(cfg, None), policy=policy,
              loop=loop, sampling=sampling, max_new_tokens=NEW_TOKENS, eos_id=None, pad_id=0,
              layout=ro.decode_layout)
    traced = jax.jit(replay_speculative, static_argnums=(1, 2, 4))
    calls = {
        "sampler_forcing_input_s": lambda: speculative_program(params, None, *inputs, **kw),
        "sampler_without_s": lambda: speculative_program(params, None, *inputs[:-1], None, **kw),
        "replay_program_s": lambda: replay_logprobs(params, cfg, policy, ro),
        "traced_replay_s": lambda: traced(params, cfg, policy, ro, loop),
    }
    for fn in calls.values():
        for _ in range(2):
            jax.block_until_ready(fn())
    times = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, fn in calls.items():
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t)
    mask = np.asarray(ro.completion_mask) > 0
    want = np.asarray(ro.logprobs)
    b = mask.shape[0]
    slices = {}
    for k in (1, 2, 4):
        parts = [take_rows(ro, np.arange(i, i + b // k)) for i in range(0, b, b // k)]
        for name, fn in (("exact", lambda r: replay_logprobs(params, cfg, policy, r)),
                         ("traced", lambda r: traced(params, cfg, policy, r, loop))):
            got = np.concatenate([np.asarray(fn(r)) for r in parts])
            slices[f"{k}/{name}"] = int((got[mask] != want[mask]).sum())
    return {"platform": f"{jax.default_backend()} ({platform.processor() or platform.machine()})",
            "jax": jax.__version__, "spec": SPEC, "rows": b, "new_tokens": NEW_TOKENS,
            "tokens": int(mask.sum()), "repeats": args.repeats,
            **{name: round(float(np.median(t)), 5) for name, t in times.items()},
            "differing_tokens_by_slices": slices}


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
