"""The GPU tier (`pytest -m gpu`, run by `benchmarks/gpu.sh`): replay == sampler on the device.

On a GPU the model-size cells run the Qwen3-0.6B and Ouro-1.4B shapes (random
weights), unless `QUICK=1`. Off a GPU the same bodies run at tiny sizes in
the slow tier (`-m slow`, about 100 s on 2 cores), so a broken call
cannot hide behind a skip until a GPU is lent. Every cell compares bits: the
replay (`rollout.replay.replay_logprobs`, the sampler's own program with the
tokens forced) against the sampler's recorded log-probs over the completion
mask, whole and in the slices a run replays. The compiled kernels' cells are
in tests/test_kernels_compiled.py (same marker).
"""

import os

import jax
import numpy as np
import pytest

from jaxrl_lp.bench.exactness import exactness_model, exactness_rollout
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rollout.generate import take_rows
from jaxrl_lp.rollout.replay import replay_logprobs

ON_GPU = jax.default_backend() in ("gpu", "cuda")
QUICK = not ON_GPU or bool(os.environ.get("QUICK"))
pytestmark = [pytest.mark.gpu] + ([] if ON_GPU else [pytest.mark.slow])


def _assert_replays(params, cfg, policy, ro, *, slices=(1, 2, 4)):
    """Replay == sampler, bit for bit on the mask, whole and in each k-way slicing."""
    mask = np.asarray(ro.completion_mask) > 0
    want = np.asarray(ro.logprobs, np.float32)
    b = want.shape[0]
    for k in slices:
        got = np.concatenate([np.asarray(replay_logprobs(
            params, cfg, policy, ro if k == 1 else take_rows(ro, np.arange(i, i + b // k))))
            for i in range(0, b, b // k)])
        differ = mask & (got.view(np.uint32) != want.view(np.uint32))
        assert not differ.any(), (k, int(differ.sum()), float(np.abs(got - want)[mask].max()))


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "ouro-1.4b"])
@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_replay_equals_the_sampler_at_model_sizes(preset, policy):
    """`bench replay`'s cell: whole, 2- and 4-way slices, shuffled rows, max_staleness 1."""
    from jaxrl_lp.bench.replay import replay_cell

    if QUICK:
        preset = {"qwen3-0.6b": "tiny-qwen3", "ouro-1.4b": "tiny-ouro"}[preset]
    size = dict(prompts=4, samples=2, prompt_len=12, new_tokens=16) if QUICK else dict(
        prompts=16, samples=2, prompt_len=128, new_tokens=64)
    cell = replay_cell(preset, Policy.parse(policy), **size)
    for k in ("whole", "slices_2", "slices_4", "rows_shuffled", "stale_1"):
        assert cell[k]["differ"] == 0, (k, cell[k])
    assert cell["other_weights_max_abs_diff"] > 0  # the replay computes with its weights


@pytest.mark.parametrize("path", ["speculative", "lora_unmerged", "mxfp8", "nvfp4"])
def test_the_other_paths_replay_exactly(path):
    """The tiny exactness cells of the other sampling paths: a speculative rollout (its
    sampler's program with the verification chunks forced), a LoRA tree sampled unmerged (base
    and adapters), the MX and NVFP4 matmul policies."""
    from jaxrl_lp.lora.adapters import init_adapters, with_adapters
    from jaxrl_lp.lora.config import LoraConfig

    policy = Policy.parse(path if path in ("mxfp8", "nvfp4") else "bf16")
    if path == "speculative":  # self-speculation: a looped target drafts at fewer loop steps
        from jaxrl_lp.rollout.sampling import SamplingConfig
        from jaxrl_lp.rollout.speculative import speculative_generate

        cfg, params, loop = exactness_model("looped_dense")
        ro = speculative_generate(params, cfg, [[1, 5, 7], [2, 9, 4, 11]], "self:loops=1,k=2",
                                  policy=policy, sampling=SamplingConfig(temperature=0.8),
                                  max_new_tokens=12, num_samples=2, loop=loop,
                                  key=jax.random.PRNGKey(2))
        _assert_replays(params, cfg, policy, ro)
        return
    cfg, params, loop = exactness_model("dense")
    if path == "lora_unmerged":
        spec = LoraConfig(rank=4)
        adapters = init_adapters(cfg, spec, jax.random.PRNGKey(3))
        adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # B off zero: the adapters act
        params = with_adapters(params, adapters, spec.alpha / spec.rank)
    ro = exactness_rollout(params, cfg, policy, loop, prompts=((1, 5, 7), (2, 9, 4, 11)),
                           num_samples=2, max_new_tokens=12)
    _assert_replays(params, cfg, policy, ro)


@pytest.mark.parametrize("kind", ["dense", "looped_deferred"])
def test_the_hybrid_step_replays_each_minibatch_by_the_samplers_program(kind):
    """bf16 on the device: the hybrid step's value for each minibatch is the sampler's bits."""
    from helpers import assert_hybrid_minibatches_are_the_samplers_bits

    cfg, params, loop = exactness_model(kind, loop_steps=2)
    policy = Policy.parse("bf16")
    ro = exactness_rollout(params, cfg, policy, loop, prompts=((1, 5, 7), (2, 9, 4, 11)),
                           num_samples=2, max_new_tokens=8)
    assert_hybrid_minibatches_are_the_samplers_bits(cfg, params, loop, ro, policy)


def test_a_run_in_minibatches_replays_at_the_samplers_bits(tmp_path):
    """`grpo.replay=always` with minibatches and micro-batches: every GRPO step's behaviour
    log-probs are replayed (exactly: mismatch 0) and verified, and the start probe passed
    its slices."""
    import json

    from helpers import TINY_MODEL, sets

    from jaxrl_lp.cli.main import main

    out = tmp_path / "run"
    argv = ["train", *sets(*TINY_MODEL, "sft.steps=10", "sft.batch_size=16", "grpo.steps=3",
                           "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.minibatches=2",
                           "grpo.micro_batches=2", "grpo.replay=always", "grpo.verify_every=1",
                           "run.progress=false", f"run.out_dir={out}")]
    assert main(argv) == 0
    grpo = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["phase"] == "grpo"]
    assert len(grpo) == 3
    assert all(r["mismatch_max_abs_dlogp"] == 0.0 for r in grpo), grpo


@pytest.mark.parametrize("sampler", ["plain", "speculative"])
def test_the_start_probe_checks_the_runs_slices(sampler):
    """The probe at a run's shapes (16 rows in 4 minibatches of 2 micro-batches) passes here,
    for the plain sampler and a self-speculative one."""
    from helpers import TINY_MODEL

    from jaxrl_lp.train import apply_overrides, load_config
    from jaxrl_lp.train.probe import probe_exactness
    from jaxrl_lp.train.validate import validate

    spec = ["grpo.speculative=self:loops=1,k=2"] if sampler == "speculative" else []
    cfg = apply_overrides(load_config(None), [*TINY_MODEL, "grpo.prompts_per_step=4",
                                              "grpo.group_size=4", "grpo.minibatches=4",
                                              "grpo.micro_batches=2", *spec])
    got = probe_exactness(cfg, validate(cfg))
    assert got is not None and got["slices"] == [4, 2] and got["tokens"] > 0, got


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "ouro-1.4b"])
@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_multiturn_episodes_replay_exactly(preset, policy):
    """Four-turn episodes with ragged turns and observations (`rollout.multiturn`): the replay
    is the sampler's bits on the policy's tokens at the model's shapes."""
    import jax.numpy as jnp

    from jaxrl_lp.models.config import get_preset
    from jaxrl_lp.models.model import init_params
    from jaxrl_lp.rollout.multiturn import (
        TurnLimits,
        TurnOutcome,
        generate_multiturn,
        replay_multiturn,
    )
    from jaxrl_lp.rollout.sampling import SamplingConfig
    from jaxrl_lp.rollout.step import LoopSpec

    if QUICK:
        preset = {"qwen3-0.6b": "tiny-qwen3", "ouro-1.4b": "tiny-ouro"}[preset]
    cfg = get_preset(preset)
    params = init_params(cfg, jax.random.PRNGKey(0))
    stop = (7, 9)
    params["lm_head"] = params["lm_head"].at[:, jnp.array(stop)].multiply(40.0)
    loop = LoopSpec("model", "deferred") if cfg.is_looped else LoopSpec()
    rows, turns = (8, 4) if QUICK else (16, 4)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(10, 200, rng.integers(3, 12))) for _ in range(rows)]
    calls: dict[int, int] = {}

    def step(rs, toks, ended):
        out = []
        for r in rs:
            k = calls[r] = calls.get(r, 0) + 1
            done = k >= 1 + r % turns
            out.append(TurnOutcome(observation=() if done else tuple(range(10, 11 + (r + k) % 5)),
                                   reward=1.0, done=done))
        return out

    limits = TurnLimits(max_turns=turns, max_turn_tokens=8 if QUICK else 32,
                        max_observation_tokens=6, stop_token_ids=stop, pad_id=0)
    pol = Policy.parse(policy)
    mt = generate_multiturn(params, cfg, prompts, step, limits, policy=pol,
                            sampling=SamplingConfig(temperature=1.0), loop=loop,
                            key=jax.random.PRNGKey(1))
    mask = np.asarray(mt.rollout.completion_mask) > 0
    assert np.asarray(mt.rollout.env_mask).sum() > 0 and len(set(mt.turns.tolist())) > 1
    got = np.asarray(replay_multiturn(params, cfg, pol, mt), np.float32)
    want = np.asarray(mt.rollout.logprobs, np.float32)
    differ = mask & (got.view(np.uint32) != want.view(np.uint32))
    assert not differ.any(), (int(differ.sum()), float(np.abs(got - want)[mask].max()))
