"""LoRA in the library: the adapted matmul, exact replay in both serving modes, adapters-only training.

- `dot` of a `LoraWeight` is `x W + ((x A) B) alpha/r`; with B = 0 it is the base's
  own bits; a quantized base is its dequantized value.
- Unmerged serving: the sampler runs the base and the adapters, and the learner's
  replay of them equals the sampler bit for bit (dense and looped-deferred; f32,
  bf16 and MX/NVFP4 bases; f32 and bf16 policies). The merged copy does not.
- Merged serving with the loss on the served copy: the replay of the merged,
  rounded copy equals its sampler bit for bit, and the gradient reaches the
  adapters through the merge (equal to differentiating the merge itself).
- A GRPO step on `LoraParams` changes the adapters, keeps every bit of the base
  (f32 and NVFP4 codes), and its optimizer state is the adapters' only.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_lp.bench.exactness import exactness_model, exactness_rollout, masked_max_abs_diff
from jaxrl_lp.lora import LoraConfig, LoraParams, LoraWeights, count_params, merge_adapters
from jaxrl_lp.lora.export import merged_exporter, served_format_exporter
from jaxrl_lp.models.layers import dot
from jaxrl_lp.models.lora import LoraWeight
from jaxrl_lp.numerics.fingerprint import fingerprint_equal, tree_fingerprint
from jaxrl_lp.numerics.formats import quantize
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rl import LossConfig, make_grpo_step
from jaxrl_lp.rl.logprobs import learner_logprobs
from jaxrl_lp.sync.export import served_params_for_forward, straight_through_served

F32, BF16 = Policy.parse("fp32"), Policy.parse("bf16")


@functools.cache
def _adapted(kind: str, base_format: str, rank: int = 4):
    """A tiny exactness model with LoRA adapters whose B is non-zero (trained-looking)."""
    cfg, params, loop = exactness_model(kind, loop_steps=2)
    weights = LoraWeights(LoraConfig(rank=rank, alpha=8.0, base_format=base_format), cfg)
    train = weights.from_params(params)
    key = jax.random.PRNGKey(5)
    adapters = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(key, a.shape), train.adapters)
    return cfg, loop, weights, LoraParams(train.base, adapters)


# ---------------------------------------------------------------- the adapted matmul
def test_dot_of_a_lora_weight_is_base_plus_scaled_product():
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(3, 5, 64), jnp.float32)
    w = jnp.asarray(rng.randn(64, 32) * 0.1, jnp.float32)
    a = jnp.asarray(rng.randn(64, 4) * 0.1, jnp.float32)
    b = jnp.asarray(rng.randn(4, 32) * 0.1, jnp.float32)
    got = dot(x, LoraWeight(w, a, b, 2.0), F32)
    want = np.asarray(x, np.float64) @ (np.asarray(w, np.float64)
                                        + 2.0 * np.asarray(a, np.float64) @ np.asarray(b, np.float64))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0)
    # B = 0: the adapter adds exactly nothing, the base's own bits.
    for pol in (F32, BF16):
        assert np.array_equal(np.asarray(dot(x, LoraWeight(w, a, jnp.zeros_like(b), 2.0), pol)),
                              np.asarray(dot(x, w, pol)))
    # A quantized base is its dequantized value, also per layer after the layer axis is gone.
    for fmt in ("mxfp8", "nvfp4"):
        q = quantize(w[None], fmt, axis=1, batch_axes=(0,))
        layer0 = jax.tree.map(lambda t: t[0], q)
        dense = np.asarray(q.dequantize())[0]
        assert np.array_equal(np.asarray(dot(x, layer0, F32)), np.asarray(dot(x, dense, F32)))


def test_fingerprint_sees_a_flipped_fp4_code():
    q = quantize(jax.random.normal(jax.random.PRNGKey(0), (2, 64, 32)), "nvfp4", axis=1,
                 batch_axes=(0,))
    codes = np.array(q.codes.astype(jnp.float32))
    codes[1, 7, 3] = -codes[1, 7, 3] if codes[1, 7, 3] else 0.5
    flipped = dataclasses.replace(q, codes=jnp.asarray(codes).astype(q.codes.dtype))
    assert not fingerprint_equal(tree_fingerprint(flipped), tree_fingerprint(q))


# ---------------------------------------------------------------- unmerged serving
# The exactness cells beyond the first run in the slow tier (`-m slow`).
SLOW = pytest.mark.slow
UNMERGED = [pytest.param(k, f, p, id=f"{k}-{f}-{p.compute_dtype}", marks=m) for k, f, p, m in (
    ("dense", "nvfp4", BF16, ()), ("looped_deferred", "f32", F32, SLOW),
    ("dense", "f32", F32, SLOW), ("dense", "bf16", BF16, SLOW),
    ("looped_deferred", "mxfp8", BF16, SLOW))]


@pytest.mark.parametrize("kind, base_format, pol", UNMERGED)
def test_unmerged_replay_equals_sampler_bit_for_bit(kind, base_format, pol):
    cfg, loop, weights, train = _adapted(kind, base_format)
    view = weights.materialize(train)  # what the sampler and the learner both read
    ro = exactness_rollout(view, cfg, pol, loop)
    assert float(ro.completion_mask.sum()) > 20
    replay = jax.jit(lambda p, r: learner_logprobs(p, cfg, pol, r, "replay")[0])
    assert masked_max_abs_diff(replay(view, ro), ro.logprobs, ro.completion_mask) == 0.0
    # The same adapters merged into one weight are another computation: the replay of the
    # merged f32 weights is off the unmerged sampler (so the equality above is not vacuous).
    if pol == BF16:
        assert masked_max_abs_diff(replay(merge_adapters(view), ro), ro.logprobs,
                                   ro.completion_mask) > 1e-4


# ---------------------------------------------------------------- merged serving
@pytest.mark.parametrize("base_format", ["nvfp4", pytest.param("bf16", marks=SLOW)])
def test_merged_served_copy_replays_bit_for_bit_with_the_gradient_to_the_adapters(base_format):
    cfg, loop, weights, train = _adapted("dense", base_format)
    ex = merged_exporter(served_format_exporter(base_format))
    view = weights.materialize(train)
    served, _ = jax.jit(ex.apply)(view, ex.init(view))
    held = served_params_for_forward(served)  # what the merged sampler runs
    ro = exactness_rollout(held, cfg, BF16, loop)
    frozen = weights.frozen(train)

    def on_served(d, method):
        used = straight_through_served(weights.model_params(d, frozen), held)
        return learner_logprobs(used, cfg, BF16, ro, method)[0]

    d = weights.differentiable(train)
    replay = jax.jit(lambda d: on_served(d, "replay"))(d)
    assert masked_max_abs_diff(replay, ro.logprobs, ro.completion_mask) == 0.0
    # Without the served copy the learner (unmerged) is off the merged sampler.
    unmerged = jax.jit(lambda p: learner_logprobs(p, cfg, BF16, ro, "replay")[0])(view)
    assert masked_max_abs_diff(unmerged, ro.logprobs, ro.completion_mask) > 1e-3
    # The straight-through gradient is the gradient of the merged weights, taken to A and B.
    w = jax.random.normal(jax.random.PRNGKey(3), ro.logprobs.shape) * ro.completion_mask

    def loss(d):
        return jnp.sum(on_served(d, "dense") * w)

    def loss_merged_weights(d):  # the same dense forward on sg(served) + (merged - sg(merged))
        merged = merge_adapters(weights.model_params(d, frozen))
        used = jax.tree.map(lambda m, s: jax.lax.stop_gradient(s) + (m - jax.lax.stop_gradient(m)),
                            merged, held)
        return jnp.sum(learner_logprobs(used, cfg, BF16, ro, "dense")[0] * w)

    g = jax.jit(jax.grad(loss))(d)
    g_ref = jax.jit(jax.grad(loss_merged_weights))(d)
    assert jax.tree.structure(g) == jax.tree.structure(d)
    for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    assert float(optax.tree.norm(g)) > 0


# ---------------------------------------------------------------- adapters-only training
@pytest.mark.parametrize("base_format", ["f32", pytest.param("nvfp4", marks=SLOW)])
def test_grpo_step_trains_the_adapters_only_and_keeps_every_bit_of_the_base(base_format):
    cfg, loop, weights, train = _adapted("dense", base_format)
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(weights.optimized(train))
    assert count_params(opt_state) == 2 * count_params(train.adapters) + 1  # m, v and a count
    step = make_grpo_step(cfg, F32, LossConfig(), optimizer, weights=weights)
    base_before = jax.tree.map(jnp.copy, train.base)
    adapters_before = jax.tree.map(jnp.copy, train.adapters)
    for i in range(2):
        ro = exactness_rollout(weights.materialize(train), cfg, F32, loop, seed=10 + i)
        adv = jnp.asarray(np.random.RandomState(i).randn(ro.logprobs.shape[0]), jnp.float32)
        train, opt_state, m = step(train, opt_state, ro, adv, ro.logprobs)
        assert float(m["skipped"]) == 0.0 and float(m["grad_norm"]) > 0
    assert isinstance(train, LoraParams)
    assert tree_fingerprint(train.base).tolist() == tree_fingerprint(base_before).tolist()
    assert jax.tree.structure(train.base) == jax.tree.structure(base_before)
    moved = [not np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(train.adapters), jax.tree.leaves(adapters_before),
                             strict=True)]
    assert all(moved)


def test_adapters_are_sharded_like_the_matmuls_they_adapt():
    from jaxrl_lp.parallel import make_mesh
    from jaxrl_lp.parallel.rules import param_logical_axes, param_shardings

    cfg, _, weights, train = _adapted("dense", "f32")
    axes = param_logical_axes(train)
    assert axes.adapters["layers"]["q_proj"]["a"] == ("layers", "embed", "lora_rank")
    assert axes.adapters["layers"]["q_proj"]["b"] == ("layers", "lora_rank", "heads")
    assert axes.adapters["layers"]["down_proj"]["a"] == ("layers", "mlp", "lora_rank")
    assert axes.base["layers"]["q_proj"] == ("layers", "embed", "heads")
    mesh = make_mesh("fsdp=4,tensor=2")
    sh = param_shardings(train, cfg, mesh)
    a_spec = sh.adapters["layers"]["q_proj"]["a"].spec
    b_spec = sh.adapters["layers"]["q_proj"]["b"].spec
    # B's output axis (heads) is on tensor, so its rank takes fsdp: every adapter is split.
    assert tuple(a_spec) == (None, "fsdp", None) and tuple(b_spec) == (None, "fsdp", "tensor")
    o_b = sh.adapters["layers"]["o_proj"]["a"].spec  # o_proj's input (heads) is on tensor
    assert tuple(o_b) == (None, "tensor", "fsdp")


# ---------------------------------------------------------------- the config
@pytest.mark.parametrize("kwargs, words", [
    ({"rank": 8, "targets": "q,qq"}, ["lora.targets", "'qq'", "q, k, v, o, gate, up, down"]),
    ({"rank": -1}, ["lora.rank", ">= 0"]),
    ({"rank": 0, "serve": "merged"}, ["lora.rank=0", "lora.serve=merged"]),
    ({"rank": 8, "base_format": "ternary"}, ["lora.base_format", "nvfp4"]),
    ({"rank": 8, "alpha": 0.0}, ["lora.alpha"]),
])
def test_lora_config_refuses_bad_values_with_one_clear_error(kwargs, words):
    with pytest.raises(ValueError) as e:
        LoraConfig(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_rank_above_a_targeted_matrix_is_refused():
    from jaxrl_lp.lora import matmul_shapes
    from jaxrl_lp.models import get_preset

    shapes = matmul_shapes(get_preset("tiny-qwen3"))  # k_proj, v_proj [64, 32]
    LoraConfig(rank=32).check_model(shapes)
    LoraConfig(rank=48, targets="q,o,gate").check_model(shapes)
    with pytest.raises(ValueError, match=r"lora.rank=33 .*k_proj.*at most 32"):
        LoraConfig(rank=33).check_model(shapes)
