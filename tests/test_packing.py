"""The padding-free learner (`models.packing`): packed rows give the unpacked values and gradients.

One batch of ragged rollouts per model kind (prompts of 1-6 tokens
left-padded to 8, completions ending at EOS or at 12 tokens): the tiny dense
model, and the tiny looped one (R = 4, exits at every loop step) in both
compute modes, whose dense forward applies the recorded exit schedule to
its packed rows. The packed dense log-probs against the plain ones, in the
plain read-out and through the fused log-prob kernel (interpret mode), one
GRPO step each way, and the same on a mesh of 8 simulated devices, where
each data shard packs its own rows. Tolerances: the two compute the same
sums with matmuls of other row counts, which XLA:CPU may round differently
(`pytest -s` prints the differences: about 5e-7 in values and 6e-7 relative
in gradients here, dense and looped alike).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_same_sgd_step

from jaxrl_lp.bench.exactness import exactness_model, exactness_rollout
from jaxrl_lp.models.packing import bucket_rows, gather_rows, make_packing, pack, unpack
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rl import LossConfig, make_grpo_step
from jaxrl_lp.rl.logprobs import dense_logprobs, packed_rows_of


@functools.cache
def _sampled(kind):
    cfg, params, loop = exactness_model(kind)
    return cfg, params, exactness_rollout(params, cfg, Policy.parse("fp32"), loop)


def batch(pol, kind="dense"):
    """The f32 rollout, read under `pol` (dense_logprobs does not check the sampler's policy)."""
    cfg, params, ro = _sampled(kind)
    return cfg, params, Policy.parse(pol), ro


def assert_same_update(plain, packed):
    """Two (params, opt_state, metrics) of one SGD(0.1) step: equal up to matmul rounding."""
    (p0, _, m0), (p1, _, m1) = plain, packed
    assert float(m1["skipped"]) == 0.0
    np.testing.assert_allclose(m1["loss"], m0["loss"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(m1["grad_norm"], m0["grad_norm"], rtol=1e-5)
    for a, c in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True):
        np.testing.assert_allclose(c, a, atol=1e-6)


def test_gather_rows_gradient_is_the_transpose_without_a_scatter():
    x = jax.random.normal(jax.random.PRNGKey(0), (6, 3))
    index = jnp.array([4, 0, 6, 2], jnp.int32)  # 6: a zero row
    inverse = jnp.array([1, 4, 3, 4, 0, 4], jnp.int32)  # 4 (= M): not taken
    y, vjp = jax.vjp(lambda a: gather_rows(a, index, inverse), x)
    y_ref, vjp_ref = jax.vjp(lambda a: jnp.take(a, index, axis=0, mode="fill", fill_value=0), x)
    g = jax.random.normal(jax.random.PRNGKey(1), y.shape)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(vjp(g)[0], vjp_ref(g)[0])
    assert "scatter" not in jax.jit(jax.grad(lambda a: jnp.sum(gather_rows(a, index, inverse) * g))
                                    ).lower(x).as_text()


def test_packing_puts_real_slots_first_and_round_trips():
    real = jnp.array([[0, 1, 1, 0], [1, 1, 0, 0]], bool)
    packing, fits = make_packing(real, 6)
    np.testing.assert_array_equal(packing.index_M, [1, 2, 4, 5, 0, 3])  # real, then padding
    assert bool(fits) and not bool(make_packing(real, 3)[1])
    x = jnp.arange(8.0).reshape(2, 4)
    back = unpack(pack(x, packing), packing, 2, 4)
    np.testing.assert_array_equal(back, jnp.where(jnp.arange(8).reshape(2, 4) < 6, x, 0.0))
    with pytest.raises(ValueError, match=r"rows=9 must be in \[1, 8\]"):
        make_packing(real, 9)


def test_bucket_rows():
    assert bucket_rows(786, 1024, 16) == 832
    assert bucket_rows(658, 896, 16) == 672
    assert bucket_rows(1024, 1024, 16) == 1024 and bucket_rows(0, 1024, 16) == 64
    assert len({bucket_rows(c, 1000, 16) for c in range(1001)}) == 16
    with pytest.raises(ValueError, match="count 9 is not in"):
        bucket_rows(9, 8, 4)


# Each looped cell compiles two looped forwards and backwards (~25 s cold on 2 cores): both
# run in the slow tier; by default a looped model's packed rows are checked through the
# hybrid step (tests/test_logprobs.py, `packed`).
@pytest.mark.parametrize("pol,kind", [
    ("fp32", "dense"),  # the GPU kernel's read-out (23 s cold on 2 cores) in the slow tier:
    pytest.param("fp32,k=interpret", "dense", marks=pytest.mark.slow),
    *(pytest.param("fp32", k, marks=pytest.mark.slow)
      for k in ("looped_deferred", "looped_dense"))])
def test_packed_dense_logprobs_equal_the_unpacked_ones(pol, kind):
    """Values and gradients of a masked loss of log-probs and entropies; NaN when rows are short.

    Looped models: the packed forward replays the same recorded schedule (in deferred mode
    an exited token's K/V at deeper steps are its exit step's), so it gives the unpacked
    values; a packing that lost the schedule would be off by more than 1e-2 here
    (tests/test_logprobs.py, `test_dense_learner_applies_the_deferred_schedule`)."""
    cfg, params, policy, ro = batch(pol, kind)
    if cfg.is_looped:  # the schedule is not trivial: tokens exit at several loop steps
        exits = np.asarray(ro.exit_steps)[np.asarray(ro.completion_mask) > 0]
        assert len(set(exits.tolist())) >= 3
    # A hole in one row's mask: the token stays context for the ones after it.
    assert float(ro.completion_mask[1, 4]) == 1.0
    ro = dataclasses.replace(ro, completion_mask=ro.completion_mask.at[1, 3].set(0.0))
    rows = packed_rows_of(ro)
    b, p = ro.prompt_tokens.shape
    n = ro.completion_tokens.shape[1]
    assert rows[0] < b * (p + n) and rows[1] < b * n  # the padding is really skipped
    weight = ro.completion_mask * jnp.arange(1.0, n + 1)

    @functools.partial(jax.jit, static_argnums=1)
    def run(params, rows):
        def loss(p):
            lp, ent = dense_logprobs(p, cfg, policy, ro, packed_rows=rows)
            return jnp.sum((lp + 0.3 * ent) * weight), (lp, ent)
        return jax.value_and_grad(loss, has_aux=True)(params)

    (_, (lp0, ent0)), g0 = run(params, None)
    (_, (lp1, ent1)), g1 = run(params, rows)
    mask = ro.completion_mask > 0
    for plain, packed in ((lp0, lp1), (ent0, ent1)):
        np.testing.assert_allclose(np.where(mask, packed, 0.0), np.where(mask, plain, 0.0),
                                   atol=1e-5)
        assert np.all(np.asarray(packed)[~np.asarray(mask)] == 0.0)
    for a, c in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(c, a, atol=1e-5 * float(jnp.max(jnp.abs(a))) + 1e-12)
    grad_rel = max(float(jnp.max(jnp.abs(c - a)) / (jnp.max(jnp.abs(a)) + 1e-12))
                   for a, c in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True))
    print(f"{pol} {kind}: packed - plain, max |dlogp| "
          f"{float(jnp.max(jnp.where(mask, abs(lp1 - lp0), 0))):.2g}"
          f", max relative gradient difference {grad_rel:.2g}")
    if (pol, kind) == ("fp32", "dense"):  # one more compilation; not the read-out's check
        (_, (short, _)), _ = run(params, (rows[0] - 8, rows[1]))
        assert bool(jnp.all(jnp.isnan(short)))


# The looped step compiles two looped GRPO steps (~25 s on shared cores): the slow tier. The
# default suite's looped steps pack (tests/test_replay_reuse.py, tests/test_parallel.py).
@pytest.mark.parametrize("kind", [
    "dense", pytest.param("looped_deferred", marks=pytest.mark.slow)])
def test_packed_grpo_step_equals_the_unpacked_step(kind):
    cfg, params, policy, ro = batch("fp32", kind)
    opt = optax.sgd(0.1)
    adv = jnp.linspace(-1.0, 1.0, ro.logprobs.shape[0])
    out = {}
    # Packed: two micro-batches (each packed to the larger one's bucket), recomputed layers.
    for buckets, mbs in ((0, 1), (16, 2)):
        step = make_grpo_step(cfg, policy, LossConfig(), opt, method="dense",
                              pack_buckets=buckets, micro_batches=mbs, remat=buckets > 0)
        assert step.packs == (buckets > 0)
        if buckets:  # the layers run on the packed rows of a micro-batch
            body, _ = packed_rows_of(ro, micro_batches=2)
            assert body < ro.logprobs.shape[0] // 2 * (ro.prompt_tokens.shape[1] + ro.logprobs.shape[1])
            text = step.lower(params, opt.init(params), ro, adv, ro.logprobs).as_text()
            assert f"tensor<1x{body}x{cfg.hidden_size}xf32>" in text
        out[buckets] = step(jax.tree.map(jnp.copy, params), opt.init(params), ro, adv,
                            ro.logprobs)
    assert_same_update(out[0], out[16])


def test_packed_forward_refuses_caches_and_the_sampler_forms():
    from jaxrl_lp.models.cache import init_cache
    from jaxrl_lp.models.loop import LoopSpec
    from jaxrl_lp.models.model import forward

    packing, _ = make_packing(jnp.ones((1, 4), bool), 4)
    tokens = jnp.ones((1, 4), jnp.int32)
    for kind in ("dense", "looped_deferred"):
        cfg, params, policy, _ = batch("fp32", kind)
        with pytest.raises(ValueError, match="no KV cache"):
            forward(params, cfg, policy, tokens, cache=init_cache(cfg, policy, 1, 4),
                    packing=packing)
    loop = LoopSpec("full", "deferred")
    with pytest.raises(ValueError, match="no early stop and the exit read-out"):
        forward(params, cfg, policy, tokens, loop=loop, early_stop=True, packing=packing)
    with pytest.raises(ValueError, match="no early stop and the exit read-out"):
        forward(params, cfg, policy, tokens, loop=loop, readout="expected", packing=packing)
    with pytest.raises(ValueError, match="groups=3 must be >= 1 and divide the 2 rows"):
        make_packing(jnp.ones((2, 4), bool), 4, groups=3)


def test_groups_pack_each_block_of_rows_apart():
    """`make_packing(groups=S)`: each block of B / S rows in rows of its own, round trip exact."""
    real = jnp.array([[0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 1], [1, 0, 1, 1]], bool)
    packing, fits = make_packing(real, 5, groups=2)
    assert packing.groups == 2 and packing.rows == 5 and bool(fits)
    # Group 0 holds rows 0-1 (flat slots 0-7), group 1 rows 2-3, each its real slots first.
    np.testing.assert_array_equal(packing.index_M, [[1, 2, 4, 5, 0], [3, 4, 6, 7, 0]])
    x = jnp.arange(16.0).reshape(4, 4)
    packed = pack(x, packing)
    assert packed.shape == (2, 5)
    # Back on the grid: the packed slots (real, and group 0's pad slot 0 of row 0, group 1's
    # of row 2), zeros elsewhere.
    kept = jnp.asarray([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 1], [1, 0, 1, 1]], bool)
    np.testing.assert_array_equal(unpack(packed, packing, 4, 4), jnp.where(kept, x, 0.0))
    assert not bool(make_packing(real, 3, groups=2)[1])  # group 1 has 4 real slots


def test_packed_sft_step_equals_the_unpacked_step():
    """The SFT step skips the tokens after each row's last target (the fused read-out of the
    same packed rows is checked above)."""
    from jaxrl_lp.data.pipeline import sft_batch
    from jaxrl_lp.rl import make_sft_step
    from jaxrl_lp.rl.logprobs import packed_rows_for

    cfg, params, policy, _ = batch("fp32")
    rs = np.random.RandomState(0)
    examples = [(list(rs.randint(3, 50, p)), list(rs.randint(3, 50, c)))
                for p, c in ((1, 4), (5, 9), (3, 2), (2, 13))]
    b = sft_batch(examples, pad_id=0, seq_len=20)
    rows = packed_rows_for(np.ones(4), b.loss_mask_BxL[:, 1:], 1)
    assert rows[0] < 4 * 20 and rows[1] < 4 * 19
    opt = optax.sgd(0.1)
    out = {}
    for buckets in (0, 16):
        step = make_sft_step(cfg, policy, opt, pack_buckets=buckets)
        out[buckets] = step(jax.tree.map(jnp.copy, params), opt.init(params),
                            jnp.asarray(b.tokens_BxL), jnp.asarray(b.loss_mask_BxL))
    assert_same_update(out[0], out[16])


# ---------------------------------------------------------------- on a mesh: each data shard packs
MESH_PROMPTS = ((1, 5, 7), (2, 9, 4, 11, 3, 8), (6,), (12, 13, 14, 15))  # x G = 2: 8 rows


# 30-100 s each on 2 shared cores: the slow tier. The default suite's sharded step
# (tests/test_parallel.py, looped deferred on both meshes) packs by default too, against the
# packed one-device step.
@pytest.mark.slow
@pytest.mark.parametrize("kind,mesh_spec", [("looped_dense", "fsdp=8"),
                                            ("looped_deferred", "data=2,fsdp=2,tensor=2")])
def test_packed_step_on_a_mesh_equals_the_unpacked_step_on_one_device(kind, mesh_spec):
    """The sharded packed step packs each data shard's rows apart (S groups, read on the
    lowered program) and updates the parameters as the unpacked one-device step does; the
    behaviour log-probs (`jit_learner_logprobs`, dense) on the mesh are packed too."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    from jaxrl_lp.parallel import make_mesh, param_shardings
    from jaxrl_lp.parallel.shard import put_tree, state_shardings
    from jaxrl_lp.rl.logprob_programs import jit_learner_logprobs
    from jaxrl_lp.rl.logprobs import pack_groups

    cfg, params, loop = exactness_model(kind)
    policy = Policy.parse("fp32")
    ro = exactness_rollout(params, cfg, policy, loop, prompts=MESH_PROMPTS, max_new_tokens=8)
    adv = jax.random.normal(jax.random.PRNGKey(5), ro.logprobs.shape[:1])
    # SGD with momentum: the update is proportional to the gradient (tests/test_parallel.py).
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5, momentum=0.9))
    copy = lambda t: jax.tree.map(jnp.copy, t)
    mb = 2 if mesh_spec.startswith("data") else 1
    one = make_grpo_step(cfg, policy, LossConfig(), opt, loop=loop, micro_batches=mb,
                         pack_buckets=0)
    p1, _, m1 = one(copy(params), opt.init(params), ro, adv, ro.logprobs)
    mesh = make_mesh(mesh_spec)
    step = make_grpo_step(cfg, policy, LossConfig(), opt, loop=loop, micro_batches=mb, mesh=mesh)
    groups = pack_groups(8 // mb, mesh)
    assert step.packs and groups == (8 if mb == 1 else 4)
    body, _ = step.rows_of(ro)
    assert body < 8 // mb // groups * (ro.prompt_tokens.shape[1] + 8)
    psh = param_shardings(params, cfg, mesh)
    state = lambda: put_tree(opt.init(params), state_shardings(opt.init(params), params, psh,
                                                               mesh))
    text = step.lower(put_tree(copy(params), psh), state(), ro, adv, ro.logprobs).as_text()
    assert f"tensor<{groups}x{body}x{cfg.hidden_size}xf32>" in text
    p8, _, m8 = step(put_tree(copy(params), psh), state(), ro, adv, ro.logprobs)
    assert_same_sgd_step((p8, m8), (p1, m1), params)
    logp = jit_learner_logprobs(cfg, policy, "dense", loop=loop, mesh=mesh, micro_batches=mb)
    assert logp.packs
    plain = jit_learner_logprobs(cfg, policy, "dense", loop=loop, pack_buckets=0)(params, ro)
    mask = np.asarray(ro.completion_mask) > 0
    np.testing.assert_allclose(np.asarray(logp(put_tree(copy(params), psh), ro))[mask],
                               np.asarray(plain)[mask], atol=1e-5)
