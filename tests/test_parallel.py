"""Sharded sampler and learner on 8 simulated CPU devices (conftest.py sets the device count).

Two mesh shapes, `fsdp=8` and `data=2,fsdp=2,tensor=2`: the sampler gives the
tokens and log-probs of one device (1e-5), a GRPO step gives its parameters
(f32, 1e-5 relative), the learner's replay on a mesh equals the sampler on the
same mesh bit for bit, and no parameter or optimizer state of a sharded step
is whole on one device.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_same_sgd_step

from jaxrl_lp.bench.exactness import exactness_model, exactness_rollout
from jaxrl_lp.models import get_preset, init_params
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.parallel import MeshSpec, make_mesh, param_shardings
from jaxrl_lp.parallel.rules import DEFAULT_RULES
from jaxrl_lp.parallel.shard import put_tree, state_shardings
from jaxrl_lp.rl import LossConfig, make_grpo_step
from jaxrl_lp.rl.logprob_programs import jit_learner_logprobs
from jaxrl_lp.rollout import SamplingConfig, generate

# The three-axis mesh runs by default; fsdp=8 (every parameter split 8 ways) in the slow
# tier (`-m slow`): 17-51 s a cell cold on 2 cores.
MESHES = ("data=2,fsdp=2,tensor=2",
          pytest.param("fsdp=8", marks=pytest.mark.slow))
PROMPTS = ((1, 5, 7), (2, 9, 4, 11, 3, 8), (6,), (12, 13, 14, 15))  # 4 prompts x G=2 = 8 rows
G = 2
N = 8
pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


@functools.cache
def model(kind):
    return exactness_model(kind)


def shard_params(params, cfg, mesh):
    return put_tree(params, param_shardings(params, cfg, mesh))


def not_whole(x) -> bool:
    """No device holds the whole array (arrays of one element cannot be split)."""
    return x.size <= 1 or all(s.data.shape != x.shape for s in x.addressable_shards)


# The looped model on the three-axis mesh by default (30 s cold on 2 cores); the dense one
# (25 s) and fsdp=8 in the slow tier.
@pytest.mark.parametrize("mesh_spec,kind", [
    pytest.param(mesh, kind, id=f"{kind}-{mesh}", marks=() if (
        kind, mesh) == ("looped_deferred", MESHES[0]) else pytest.mark.slow)
    for kind in ("dense", "looped_deferred") for mesh in (MESHES[0], "fsdp=8")])
def test_sampler_on_a_mesh_equals_one_device_and_replay_is_exact(mesh_spec, kind):
    cfg, params, loop = model(kind)
    mesh = make_mesh(mesh_spec)
    sharded = shard_params(params, cfg, mesh)
    # Greedy: the same tokens as one device, log-probs within 1e-5.
    greedy = dict(sampling=SamplingConfig(greedy=True), max_new_tokens=N, num_samples=G,
                  eos_id=3, loop=loop)
    one = generate(params, cfg, PROMPTS, **greedy)
    many = generate(sharded, cfg, PROMPTS, mesh=mesh, **greedy)
    np.testing.assert_array_equal(np.asarray(many.completion_tokens),
                                  np.asarray(one.completion_tokens))
    np.testing.assert_array_equal(np.asarray(many.exit_steps), np.asarray(one.exit_steps))
    np.testing.assert_allclose(np.asarray(many.logprobs), np.asarray(one.logprobs), atol=1e-5)
    assert many.completion_tokens.sharding.spec[0] is not None  # rows over the data shards
    # Sampled at a temperature on the mesh, then replayed on the same mesh: bit for bit.
    ro = generate(sharded, cfg, PROMPTS, sampling=SamplingConfig(temperature=0.8), eos_id=3,
                  loop=loop, key=jax.random.PRNGKey(1), mesh=mesh, max_new_tokens=N,
                  num_samples=G)
    replay = jit_learner_logprobs(cfg, Policy.parse("fp32"), "replay", mesh=mesh)(sharded, ro)
    mask = np.asarray(ro.completion_mask) > 0
    assert np.array_equal(np.asarray(replay)[mask], np.asarray(ro.logprobs)[mask])


def _mesh_matches_one_device(kind: str, policy: Policy, check_replay=None) -> None:
    """The sampler under `policy` on `data=2,fsdp=2,tensor=2`: one device's greedy tokens
    (log-probs within 1e-5), and its replay on the mesh bit-equal to it. `check_replay(fn,
    sharded, rollout)` may read the replay's program first."""
    cfg, params, loop = model(kind)
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    sharded = shard_params(params, cfg, mesh)
    greedy = dict(sampling=SamplingConfig(greedy=True), max_new_tokens=N, num_samples=G,
                  eos_id=3, loop=loop, policy=policy)
    one = generate(params, cfg, PROMPTS, **greedy)
    many = generate(sharded, cfg, PROMPTS, mesh=mesh, **greedy)
    np.testing.assert_array_equal(np.asarray(many.completion_tokens),
                                  np.asarray(one.completion_tokens))
    np.testing.assert_allclose(np.asarray(many.logprobs), np.asarray(one.logprobs), atol=1e-5)
    replay_fn = jit_learner_logprobs(cfg, policy, "replay", mesh=mesh)
    if check_replay is not None:
        check_replay(replay_fn, sharded, many)
    replay = replay_fn(sharded, many)
    mask = np.asarray(many.completion_mask) > 0
    assert np.array_equal(np.asarray(replay)[mask], np.asarray(many.logprobs)[mask])


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("kind", ["dense", "looped_deferred"])
def test_an_fp8_decode_copy_on_a_mesh_gives_one_devices_tokens_and_an_exact_replay(kind):
    """Under `fp8` the sampler quantizes its sharded weights once a call
    (`blocks.decode_weights`: one scale a layer, across the shards) and reads the codes: on
    a mesh one device's greedy tokens and an exact replay (`_mesh_matches_one_device`)."""
    _mesh_matches_one_device(kind, Policy.parse("fp8"))


def test_kernels_run_per_shard_on_a_mesh():
    """Under a mesh every kernel runs in a `shard_map` on its device's rows (and heads): the
    interpreted kernels' sampler on `data=2,fsdp=2,tensor=2` gives one device's greedy tokens
    (log-probs within 1e-5), and its replay on the mesh is bit-equal to it."""
    def in_shard_map(replay_fn, sharded, rollout):
        assert "shard_map" in str(replay_fn.trace(sharded, rollout).jaxpr)

    _mesh_matches_one_device("dense", Policy.parse("fp32,k=interpret"), in_shard_map)


def _grpo_inputs(cfg, params, loop):
    ro = exactness_rollout(params, cfg, Policy.parse("fp32"), loop, prompts=PROMPTS,
                           num_samples=G, max_new_tokens=N)
    adv = jax.random.normal(jax.random.PRNGKey(5), ro.logprobs.shape[:1])
    return ro, adv


@pytest.mark.parametrize("mesh_spec", MESHES)
def test_grpo_step_on_a_mesh_equals_one_device_and_nothing_is_whole(mesh_spec):
    cfg, params, loop = model("looped_deferred")
    # SGD with momentum: the update is proportional to the gradient, so the parameters
    # compare the gradients (Adam divides near-zero gradients by their own size, which
    # turns last-bit differences of a gradient of 1e-9 into differences of the update).
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5, momentum=0.9))
    ro, adv = _grpo_inputs(cfg, params, loop)
    loss = LossConfig()
    copy = lambda t: jax.tree.map(jnp.copy, t)
    one = make_grpo_step(cfg, Policy.parse("fp32"), loss, opt, loop=loop, micro_batches=2)
    p1, o1, m1 = one(copy(params), opt.init(params), ro, adv, ro.logprobs)
    mesh = make_mesh(mesh_spec)
    step = make_grpo_step(cfg, Policy.parse("fp32"), loss, opt, loop=loop, micro_batches=2,
                          mesh=mesh)
    # Both skip the padding, the mesh step each data shard's rows apart (tests/test_packing.py
    # compares it with the unpacked step).
    assert one.packs and step.packs
    sharded = shard_params(copy(params), cfg, mesh)
    state = put_tree(opt.init(params), state_shardings(opt.init(params), params,
                                                       param_shardings(params, cfg, mesh), mesh))
    p8, o8, m8 = step(sharded, state, ro, adv, ro.logprobs)
    assert float(m8["grad_norm"]) > 0
    assert_same_sgd_step((p8, m8), (p1, m1), params)
    # Sharded in, sharded out: no parameter or optimizer moment is whole on one device.
    assert all(not_whole(x) for x in jax.tree.leaves(p8)), "a parameter is whole on a device"
    moments = [x for x in jax.tree.leaves(o8) if x.ndim > 0]
    assert moments and all(not_whole(x) for x in moments), "an optimizer moment is whole"
    # A second call with the same shapes reuses the compiled program.
    step(p8, o8, ro, adv, ro.logprobs)
    assert step._cache_size() == 1


def test_mesh_specs_and_bad_input():
    assert MeshSpec.parse("data=2,fsdp=2,tensor=2").size == 8
    assert str(MeshSpec.parse("tensor=2, data=4")) == "data=4,tensor=2"
    assert MeshSpec.parse("").size == 1
    with pytest.raises(ValueError, match="has 4 devices but there are 8"):
        make_mesh("fsdp=4")
    with pytest.raises(ValueError, match="'batch=8' is not AXIS=SIZE"):
        MeshSpec.parse("batch=8")
    with pytest.raises(ValueError, match="given twice"):
        MeshSpec.parse("fsdp=2,fsdp=4")
    cfg = get_preset("tiny-qwen3")  # 4 heads, 2 KV heads
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    with pytest.raises(ValueError, match=r"model.num_kv_heads=2 does not divide by the mesh's "
                                         r"tensor=4"):
        param_shardings(params, cfg, make_mesh("data=2,tensor=4"))


@pytest.fixture(scope="module")
def tiny_ouro_checkpoint(tmp_path_factory):
    """A random tiny looped checkpoint whose sizes divide by every mesh axis (vocab 128)."""
    from jaxrl_lp.models.hf_io import save_hf_checkpoint

    cfg = get_preset("tiny-ouro").replace(loop_steps=2, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny_ouro")
    save_hf_checkpoint(path, cfg, init_params(cfg, jax.random.PRNGKey(3)))
    return path


@pytest.mark.slow
def test_training_on_a_mesh_and_its_checkpoint_on_other_meshes(tmp_path, tiny_ouro_checkpoint):
    """`jaxrl-lp train --set run.mesh=...`: the same run as on one device, exact replay on
    the mesh, and its checkpoint restored on another mesh shape and on one device."""
    from helpers import short_run

    from jaxrl_lp.train import apply_overrides, default_config, run_train
    from jaxrl_lp.train.checkpoint import Checkpointer
    from jaxrl_lp.train.program import initial_state

    base = [*short_run(sft_steps=2, grpo_steps=2), f"init_from={tiny_ouro_checkpoint}",
            "grpo.prompts_per_step=4", "sft.batch_size=8", "grpo.verify_every=1"]
    runs = {}
    for name, mesh in (("one", ""), ("mesh", "data=2,fsdp=2,tensor=2")):
        cfg = apply_overrides(default_config(), [*base, f"run.mesh={mesh}",
                                                 f"run.out_dir={tmp_path / name}"])
        runs[name] = (cfg, run_train(cfg))
    records = {n: [json.loads(x) for x in
                   (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in runs}
    for a, b in zip(records["one"], records["mesh"], strict=True):
        assert (a["step"], a["phase"]) == (b["step"], b["phase"])
        if a["phase"] == "sft":
            np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)
    grpo = [r for r in records["mesh"] if r["phase"] == "grpo"]
    # Exact on the mesh: every step's batch replayed (`grpo.verify_every=1`) and bit-equal.
    assert grpo and all(r["mismatch_max_abs_dlogp"] == 0.0 and r["replay_verified"] == 1.0
                        for r in grpo)
    # The mesh run's checkpoint, restored onto another mesh shape and onto one device.
    cfg = runs["mesh"][0]
    ckpt = Checkpointer(cfg.run.out_dir)
    restored = []
    for mesh in ("fsdp=4,tensor=2", ""):
        other = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, mesh=mesh))
        plan, like, _ = initial_state(other)
        state, _ = ckpt.restore(like.tree(), plan.model)
        if mesh:
            assert all(not_whole(x) for x in jax.tree.leaves(state["params"]))
        restored.append(state)
    ckpt.close()
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 *restored)


def test_hf_checkpoint_loads_into_its_shards(tiny_ouro_checkpoint):
    from jaxrl_lp.models.hf_config import read_hf_config
    from jaxrl_lp.models.hf_io import load_hf_params

    cfg = read_hf_config(tiny_ouro_checkpoint)
    whole = load_hf_params(tiny_ouro_checkpoint, cfg)
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    sharded = load_hf_params(tiny_ouro_checkpoint, cfg,
                             shardings=param_shardings(whole, cfg, mesh))
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(whole), strict=True):
        assert a.sharding.mesh.shape == mesh.shape and not_whole(a)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sync_checks_and_hashes_on_a_sharded_export():
    """The seven checks run on sharded trees (per-shard hashes); faults are still caught."""
    from jaxrl_lp.sync import expected_layout, hash_served, quantize, run_sync_checks
    from jaxrl_lp.sync.report import SamplerState

    cfg, params, _ = model("looped_deferred")
    mesh = make_mesh("fsdp=8")
    sharded = shard_params(params, cfg, mesh)
    exporter = quantize("mxfp8")
    served, _ = jax.jit(exporter.apply)(sharded, exporter.init(sharded))
    hashes = hash_served(served)
    tokens = jnp.asarray([[1, 5, 7, 9]], jnp.int32)
    kw = dict(cfg=cfg, probe_tokens=tokens, learner_policy=Policy.parse("fp32"), master=sharded)
    ok = run_sync_checks(served, hashes, SamplerState(served, 3, 3, Policy.parse("fp32")),
                         expected_layout(exporter, params), 3, **kw)
    assert ok.passed, str(ok)
    # The same export unsharded hashes otherwise (the digest covers the shard layout) but
    # reads back the same bits; one flipped payload bit on one shard fails check 2.
    emb = served["embed"]
    flipped = jax.device_put(
        np.asarray(emb).view(np.uint32).__xor__(np.uint32(1) << 3 * (np.arange(emb.size)
                                                                     .reshape(emb.shape) == 0))
        .view(np.float32), emb.sharding)
    bad = run_sync_checks(served, hashes, SamplerState({**served, "embed": flipped}, 3, 3,
                                                    Policy.parse("fp32")),
                          expected_layout(exporter, params), 3, **kw)
    assert not bad.passed and "hashes" in str(bad)


def test_a_mesh_step_refuses_an_argument_it_has_no_kind_for():
    """A mesh step places each argument by its kind; one more than its kinds is an error, not
    an argument silently dropped (as on one device)."""
    from jaxrl_lp.rl.learner_step import LearnerStep

    cfg, params, _ = model("dense")
    step = LearnerStep(lambda p, s: (p, s, {}), ("params", "state"), mesh=make_mesh("fsdp=8"),
                       cfg=cfg, rules=DEFAULT_RULES)
    with pytest.raises(TypeError, match=r"at most 2 arguments \(params, state\); got 3"):
        step(params, {}, params)
    one = LearnerStep(lambda p, s: (p, s, {}), ("params", "state"))
    with pytest.raises(TypeError, match=r"at most 2 arguments \(params, state\); got 3"):
        one(params, {}, params)
