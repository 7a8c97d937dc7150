"""The invariant log-probs: one parallel forward whose values are the sampler's decode bits.

A rollout sampled in the `invariant` decode layout (`numerics.invariant`: the
batch-invariant forms) is read by the learner's `invariant` program, one
packed parallel forward over every token: on the whole batch, on 2- and 4-way
row slices, and inside a gradient's program, its log-probs are the sampler's
bit for bit; under weights moved by a step they are the replay's (which stays
the reference). Dense and looped deferred models, fp32 and bf16 policies, and the
quantized ones whose quantizer sums nothing (FP8, MXFP8, MXFP4, NVFP4).

The model is wider than the tiny presets (hidden 256, head width 64): at a
hidden size of 64 XLA:CPU's products give a row the same bits at every row
count anyway, and a form reverted to the plain one would pass unseen.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_lp.models.config import get_preset
from jaxrl_lp.models.model import init_params
from jaxrl_lp.numerics.invariant import (
    COLUMN_TILES,
    COMPILER_OPTIONS,
    MAX_COLUMN_TILE,
    InvariantForm,
    column_residues,
    column_tile,
    form_for,
    form_holds,
    invariant_forms,
    opaque_zero,
    padded_rows,
    row_chunk,
    unsupported,
    weights_major_product,
)
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rl.logprob_programs import jit_learner_logprobs
from jaxrl_lp.rl.logprobs import learner_logprobs, packed_rows_of
from jaxrl_lp.rl.loss import LossConfig
from jaxrl_lp.rl.train_step import make_grpo_step
from jaxrl_lp.rollout.generate import generate, take_rows
from jaxrl_lp.rollout.replay import replay_logprobs
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.rollout.step import LoopSpec
from jaxrl_lp.train.behaviour import bit_mismatch

EOS = 3
PROMPTS = ((1, 5, 7), (2, 9, 4, 11, 3, 8), (6,), (12, 13, 14, 15))


def _model(kind: str):
    """One layer at widths where XLA:CPU's plain forms depend on the row count."""
    cfg = get_preset("tiny-qwen3").replace(hidden_size=256, intermediate_size=512, num_heads=4,
                                           num_kv_heads=2, head_dim=64, vocab_size=512,
                                           num_layers=1)
    loop = LoopSpec()
    if kind == "looped_deferred":
        cfg = cfg.replace(family="ouro", loop_steps=3, qk_norm=False)
        loop = LoopSpec("threshold:0.5", "deferred")
    params = init_params(cfg, jax.random.PRNGKey(0))
    params["lm_head"] = params["lm_head"].at[:, EOS].multiply(6.0)  # some rows end early
    if cfg.is_looped:  # exits at every loop step (`bench.exactness.exactness_model`)
        params["exit_gate"] = {"kernel": params["exit_gate"]["kernel"] * 20.0,
                               "bias": params["exit_gate"]["bias"] + 2.0}
    return cfg, params, loop


def _rollout(cfg, params, loop, policy, layout="invariant", form=None):
    return generate(params, cfg, PROMPTS, policy=policy, sampling=SamplingConfig(temperature=0.8),
                    max_new_tokens=12, num_samples=2, eos_id=EOS, loop=loop,
                    key=jax.random.PRNGKey(1), decode_layout=layout, invariant_form=form)


def _form(name: str) -> InvariantForm:
    """`this_cpu`'s (`form_for`), the row chunks, or the weights-major `columns` (skipped
    where no column tile holds)."""
    if name == "this_cpu":
        return form_for(8)
    if name == "row_chunks":
        return InvariantForm(row_chunk())
    if column_tile() is None:
        pytest.skip(f"no column tile of {COLUMN_TILES} holds on this CPU")
    return InvariantForm(row_chunk(), column_tile())


def _exact(got, want, ro, what):
    differ, tokens, worst = bit_mismatch(got, want, ro.completion_mask)
    assert tokens > 0 and (differ, worst) == (0, 0.0), (what, differ, tokens, worst)


# Each case compiles a sampler and four learner programs (73-84 s cold with the row chunks on
# the 2-core Zen 3 of 2026-12-07): the default suite takes the dense model in f32 in this
# CPU's form, the slow tier the other three and all four in the row chunks.
CASES = [pytest.param(kind, pol, form, marks=() if (kind, pol, form) == ("dense", "fp32", "this_cpu")
                      else pytest.mark.slow)
         for form in ("this_cpu", "row_chunks") for kind in ("dense", "looped_deferred")
         for pol in ("fp32", "bf16")]
# The quantized policies (`kernels.fake_quant.INVARIANT_FORMATS`): per-tensor FP8 in the
# default suite, dense in this CPU's form (its products summed in the plain form differ here,
# `test_a_quantized_policys_plants_break_the_equality`; MXFP8's happened to give the same bits
# at these widths); MXFP8, the configs' policy, in every model and form, and the other
# formats, in the slow tier.
CASES += [pytest.param(kind, pol, form, marks=() if (kind, pol, form) == (
    "dense", "fp8", "this_cpu") else pytest.mark.slow)
          for form in ("this_cpu", "row_chunks") for kind in ("dense", "looped_deferred")
          for pol in ("mxfp8", "fp8", "mxfp4", "nvfp4")
          if pol == "mxfp8" or (kind, form) == ("dense", "this_cpu")]
# The weights-major copy of f16 params under bf16 compute (`decode_weights` leaves them
# unrounded, since rounding twice would not be idempotent; the copy rounds once before it
# quantizes, as the product does: red without it), in the columns whatever this CPU's form.
CASES += [pytest.param("dense", "p=f16,c=bf16,mm=nvfp4", "columns", marks=pytest.mark.slow)]


@pytest.mark.parametrize(("kind", "policy", "form"), CASES)
def test_the_parallel_forward_is_the_samplers_bits(kind, policy, form):
    """Whole batch, 2- and 4-way slices (packed, as the learner step packs), and the value
    inside a gradient's program: the sampler's bits; under moved weights the replay's."""
    policy = Policy.parse(policy)
    cfg, params, loop = _model(kind)
    if policy.matmul_format == "mxfp4":  # its 4-bit head needs more to end some rows early
        params["lm_head"] = params["lm_head"].at[:, EOS].multiply(3.0)
    ro = _rollout(cfg, params, loop, policy, form=_form(form))
    assert ro.invariant_form == _form(form)
    lengths = np.asarray(ro.completion_mask).sum(1)
    assert lengths.min() < lengths.max(), lengths  # EOS in play
    if cfg.is_looped:
        assert len(np.unique(np.asarray(ro.exit_steps)[np.asarray(ro.completion_mask) > 0])) > 1
    program = jit_learner_logprobs(cfg, policy, "invariant")
    _exact(program(params, ro), ro.logprobs, ro, "whole batch")
    for ways in (2, 4):
        size = 8 // ways
        for i in range(0, 8, size):
            rows = take_rows(ro, np.arange(i, i + size))
            _exact(program(params, rows), rows.logprobs, rows, f"{ways}-way slice at {i}")

    def loss(p, r, packed):  # the value as a gradient's program computes it
        lp, ent = learner_logprobs(p, cfg, policy, r, "invariant", packed_rows=packed)
        return jnp.sum(lp * r.completion_mask) + 0.01 * jnp.sum(ent), lp

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=2,
                   compiler_options=COMPILER_OPTIONS)
    half = take_rows(ro, np.arange(4))
    for packed in (packed_rows_of(half), None):  # packed as the step runs, and on the grid
        (_, lp), g = grad(params, half, packed)
        _exact(lp, half.logprobs, half, f"inside value_and_grad, packed {packed}")
        assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(g))

    moved = jax.tree.map(lambda x: x * 1.01, params)  # weights a step moved
    for rows in (np.arange(8), np.arange(2, 4)):
        r = take_rows(ro, rows)
        _exact(program(moved, r), replay_logprobs(moved, cfg, policy, r), r,
               f"moved weights, rows {rows.tolist()}")


@pytest.mark.parametrize("form", ["row_chunks", "columns"])
def test_a_decode_of_more_rows_than_a_chunk_or_a_tile_runs_in_its_form(form):
    """A decode of more rows than this CPU's row chunk runs its products by chunks as the
    learner does (whole products of more rows are no class: their kernels change with the
    row count), or in the weights-major form over tiles of columns, and the learner's forward
    reads it whole and by a slice: the sampler's bits. A rollout sampled in chunks or tiles
    this CPU's products do not hold is refused in one line, and so is such a form asked of
    the sampler."""
    import dataclasses

    policy = Policy.parse("fp32")
    cfg, params, loop = _model("dense")
    chunk, given = row_chunk(), _form(form)
    prompts = [PROMPTS[i % len(PROMPTS)] + (i,) for i in range(chunk // 2 + 1)]
    sample = lambda f: generate(params, cfg, prompts, policy=policy,
                                sampling=SamplingConfig(temperature=0.8), max_new_tokens=6,
                                num_samples=2, eos_id=EOS, key=jax.random.PRNGKey(2),
                                decode_layout="invariant", invariant_form=f)
    ro = sample(given)
    assert ro.completion_tokens.shape[0] > chunk and ro.invariant_form == given
    program = jit_learner_logprobs(cfg, policy, "invariant")
    _exact(program(params, ro), ro.logprobs, ro, "whole batch")
    part = take_rows(ro, np.arange(4))
    _exact(program(params, part), part.logprobs, part, "4 rows")
    if form == "row_chunks":
        other, match = given._replace(chunk=chunk // 2), f"chunks of {chunk // 2} rows"
    else:
        other, match = given._replace(columns=given.columns * 2), "column tiles of"
    with pytest.raises(ValueError, match=f"{match}.*grpo.logprobs=hybrid"):
        program(params, dataclasses.replace(ro, invariant_form=other))
    with pytest.raises(ValueError, match=re.escape(f"invariant_form {other}: ") + f".*{match}"):
        sample(other)


@pytest.mark.parametrize(("kind", "policy"), [  # the looped cell (39 s cold on 2 cores) and
    ("dense", "fp32"),                           # the FP8 one in the slow tier
    pytest.param("looped_deferred", "fp32", marks=pytest.mark.slow),
    pytest.param("dense", "fp8", marks=pytest.mark.slow)])
def test_the_invariant_gradient_is_the_dense_learners(kind, policy, monkeypatch):
    """Only the value is the decode's: the gradient of a loss over the invariant log-probs is
    the dense learner's (every parameter within 1e-4 of its norm, f32; `rl.logprobs`'
    `_invariant_logprobs` recomputes the plain forward for it). The plant: the invariant
    forward differentiated as it is, with `apart`'s bits passed through integers that carry
    no gradient (as the forms first were), leaves every parameter but the lm head without
    one."""
    import jaxrl_lp.numerics.invariant as inv
    import jaxrl_lp.rl.logprobs as logprobs

    policy = Policy.parse(policy)
    cfg, params, loop = _model(kind)
    ro = take_rows(_rollout(cfg, params, loop, policy), np.arange(4))

    def grads(method):
        def loss(p):
            lp, ent = learner_logprobs(p, cfg, policy, ro, method, loop=loop)
            return jnp.sum(lp * ro.completion_mask) + 0.01 * jnp.sum(ent * ro.completion_mask)
        options = COMPILER_OPTIONS if method == "invariant" else None
        return jax.jit(jax.grad(loss), compiler_options=options)(params)

    def off(got, want):  # per parameter: |got - want| / |want| (0 where both are 0)
        return {jax.tree_util.keystr(k): float(jnp.linalg.norm(a - b)
                                               / max(float(jnp.linalg.norm(b)), 1e-30))
                for (k, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                                     jax.tree.leaves(want), strict=True)}

    dense = grads("dense")
    assert sum(float(jnp.linalg.norm(x)) > 0 for x in jax.tree.leaves(dense)) >= 10
    assert max(off(grads("invariant"), dense).values()) < 1e-4, off(grads("invariant"), dense)
    monkeypatch.setattr(logprobs, "_invariant_logprobs", logprobs._invariant_logprobs.fun)
    monkeypatch.setattr(inv, "_xor_zero", inv._xor_zero.fun)
    planted = {k: v for k, v in off(grads("invariant"), dense).items() if "exit_gate" not in k}
    # The lm head keeps a gradient, through values that under FP8 round apart from the dense
    # forward's by a code here and there (0.7% of its norm, measured).
    head_tol = 1e-4 if policy.matmul_format is None else 0.05
    assert planted.pop("['lm_head']") < head_tol and min(planted.values()) == 1.0, planted


def test_the_invariant_step_runs_at_ratio_one(monkeypatch):
    """The GRPO step of `method='invariant'` is the hybrid's update whose value, where none is
    given, is the invariant forward of the minibatch (a forward-only program, the forms'
    compiler options), never the replay: 2-row minibatches at the sampler's weights run at
    ratio 1."""
    import jaxrl_lp.rl.train_step as train_step

    policy = Policy.parse("fp32")
    cfg, params, loop = _model("dense")
    ro = _rollout(cfg, params, loop, policy)
    step = make_grpo_step(cfg, policy, LossConfig(), optax.sgd(0.0), loop=loop,
                          method="invariant", micro_batches=2)
    assert step.prepare is not None and step.compiler_options is None
    monkeypatch.setattr(train_step, "replay_logprobs", None)  # a replay would fail
    for i in (0, 6):
        rows = take_rows(ro, np.arange(i, i + 2))
        copy = jax.tree.map(jnp.copy, params)
        _, _, m = step(copy, optax.sgd(0.0).init(copy), rows, jnp.asarray([1.0, -1.0]),
                       rows.logprobs)
        assert float(m["ratio_mean"]) == 1.0, (i, float(m["ratio_mean"]))


def test_another_layouts_rollout_is_refused_and_a_mesh_replays():
    """The invariant forward reproduces the `invariant` layout only (another layout's decode
    sums otherwise: refused, never silently inexact); off XLA:CPU or on a mesh the program
    is the replay, exact there."""
    policy = Policy.parse("fp32")
    cfg, params, loop = _model("dense")
    ro = _rollout(cfg, params, loop, policy, layout="transposed")
    with pytest.raises(ValueError, match="'invariant' decode layout"):
        jit_learner_logprobs(cfg, policy, "invariant")(params, ro)
    assert unsupported("cuda") is not None and unsupported("cpu") is None
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1),
                             ("data", "fsdp", "tensor"))
    assert type(jit_learner_logprobs(cfg, policy, "invariant", mesh=mesh)).__name__ == \
        "ReplayProgram"


@pytest.mark.parametrize("form", ["this_cpu", "fixed_tiles"])
def test_attention_over_the_cache_is_the_same_for_one_query_or_all(form, monkeypatch):
    """The invariant attention of one query (a decode step) over a cache is the bits of the
    same query among all of a parallel forward's, at a cache long and wide enough (520 slots,
    head width 128) that the plain products give a query other bits by the query count: in
    this CPU's form, and with its products in fixed tiles (`kernels.fixed_tile`'s TPU version
    interpreted), where the plant is the attention's products back to XLA's."""
    import jaxrl_lp.numerics.invariant as inv
    from jaxrl_lp.models.attention import attention
    from jaxrl_lp.numerics.invariant import form_for, invariant_forms, opaque_zero

    if form == "fixed_tiles" and not _tile_places_hold():
        pytest.skip("Pallas's TPU interpreter sums a row by its place in the tile on this CPU")
    the_form = form_for(2) if form == "this_cpu" else InvariantForm(0, None, "interpret-tpu")

    policy = Policy.parse("fp32")
    b, h, kv, dh, s = 2, 4, 2, 128, 520
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (b, s, h, dh))
    k, v = (jax.random.normal(x, (b, kv, s, dh)) for x in keys[1:])
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))

    def differing(forms: bool) -> list[int]:
        def attend(q, q_pos):
            with invariant_forms(opaque_zero(jnp.int32(0)), the_form if forms else None):
                return attention(q, k, v, q_pos, pos, policy)

        run = jax.jit(attend, compiler_options=COMPILER_OPTIONS)
        every = np.asarray(run(q, pos)).view(np.uint32)
        return [int((np.asarray(run(q[:, t:t + 1], pos[:, t:t + 1]))[:, 0].view(np.uint32)
                     != every[:, t]).sum()) for t in (0, 1, 7, 300, s - 1)]

    assert differing(True) == [0] * 5
    if form == "this_cpu":
        assert sum(differing(False)) > 0  # the plant: the plain attention, the same inputs
    else:  # the plant: the tiles' products XLA's, all else in the forms
        monkeypatch.setattr(inv, "_fixed_tiles", lambda form, x, w: jnp.matmul(
            x, w, precision="highest", preferred_element_type=jnp.float32))
        assert sum(differing(True)) > 0


def test_the_weight_products_back_to_the_plain_form_break_the_equality(monkeypatch):
    """The forms are what makes the equality: the learner's weight products reverted to the
    plain `x @ W`, the same rollout's log-probs are not the sampler's bits at this model's
    widths (`benchmarks/batch_invariance.py --parts model` reverts each form in turn; the
    attention's is planted in the test below, at a cache where it matters). In the
    weights-major form (this CPU's where its column tile is small), the learner's products
    not padded to whole tiles (a row summed by the kernel of a narrow last tile) break it
    too, and where the sampler padded its 8 rows to half a tile (`InvariantForm.residue`),
    the learner's padded to whole tiles do."""
    import jaxrl_lp.models.layers as layers
    import jaxrl_lp.numerics.invariant as inv

    policy = Policy.parse("fp32")
    cfg, params, loop = _model("dense")
    ro = _rollout(cfg, params, loop, policy)  # sampled with every form in place
    program = jit_learner_logprobs(cfg, policy, "invariant")
    slices = [ro, take_rows(ro, np.arange(2)), take_rows(ro, np.arange(1))]
    for r in slices:
        _exact(program(params, r), r.logprobs, r, "before the plant")

    def differing(**plant):
        with monkeypatch.context() as m:
            for name, fn in plant.items():
                m.setattr(inv, name, fn)
            planted = jit_learner_logprobs(cfg, policy, "invariant")  # traced anew, planted
            return sum(bit_mismatch(planted(params, r), r.logprobs, r.completion_mask)[0]
                       for r in slices)

    assert differing(invariant_dot=lambda x, w, policy: layers._f32_product(x, w, policy)) > 0, \
        "the products reverted to the plain form, yet every log-prob is the sampler's"
    if ro.invariant_form.columns is not None:
        columns_product = inv.columns_product
        assert differing(columns_product=lambda x, w, columns, residue: columns_product(
            x, w, 1)) > 0, "the columns unpadded, yet every log-prob is the sampler's"
    if ro.invariant_form.residue:  # sampled padding 8 rows to half a tile, read in whole tiles
        assert differing(columns_product=lambda x, w, columns, residue: columns_product(
            x, w, columns)) > 0, "the residue dropped, yet every log-prob is the sampler's"


def test_a_quantized_policys_plants_break_the_equality(monkeypatch):
    """Under per-tensor FP8 the learner's invariant forward is the sampler's bits because its
    product of `Q(x)` and `Q(w)` takes the invariant form and each token's activation scale is
    its own: the product reverted to the plain `Q(x) @ Q(w)`, or one activation scale for the
    whole batch, and the same rollout's log-probs are not the sampler's."""
    import jaxrl_lp.models.layers as layers
    import jaxrl_lp.numerics.invariant as inv

    policy = Policy.parse("fp8")
    cfg, params, loop = _model("dense")
    ro = _rollout(cfg, params, loop, policy)
    slices = [ro, take_rows(ro, np.arange(2)), take_rows(ro, np.arange(1))]
    program = jit_learner_logprobs(cfg, policy, "invariant")
    for r in slices:
        _exact(program(params, r), r.logprobs, r, "before the plant")

    def differing(module, name, fn):
        with monkeypatch.context() as m:
            m.setattr(module, name, fn)
            planted = jit_learner_logprobs(cfg, policy, "invariant")  # traced anew, planted
            return sum(bit_mismatch(planted(params, r), r.logprobs, r.completion_mask)[0]
                       for r in slices)

    plain = lambda x, w: jnp.dot(x, w, precision="highest", preferred_element_type=jnp.float32)
    assert differing(inv, "weights_product", plain) > 0, \
        "the quantized products reverted to the plain form, yet every log-prob is the sampler's"
    qmm = layers.quantized_matmul
    per_tensor = lambda x, w, fmt, **kw: qmm(x, w, fmt, **{**kw, "batch_axes": ()})
    assert differing(layers, "quantized_matmul", per_tensor) > 0, \
        "one activation scale for the batch, yet every log-prob is the sampler's"


def test_the_weights_major_copy_of_a_quantized_policy_leaves_its_loop_the_activations(
        monkeypatch):
    """Under NVFP4 (whose weights the plain decode quantizes on every step) the sampler in the
    weights-major form reads each weight's `Q(w)` values from its copy, made once a call: its
    program quantizes activations only. In the row chunks, which read the weights as stored,
    the same policy's program quantizes every matmul weight again."""
    import jaxrl_lp.kernels.fake_quant as fake_quant

    policy = Policy.parse("nvfp4")
    cfg, params, loop = _model("dense")
    weight_shapes = {tuple(x.shape[-2:]) for x in jax.tree.leaves(params) if x.ndim >= 2}

    def quantized_in_the_sampler(form):  # (weights, activations) quantized while it traces
        weights, acts, real = [], [], fake_quant.quantize

        def counting(x, fmt, axis=0, batch_axes=(), **kw):
            is_weight = x.ndim == 2 and tuple(x.shape) in weight_shapes
            (weights if is_weight else acts).append(tuple(x.shape))
            return real(x, fmt, axis, batch_axes, **kw)

        with monkeypatch.context() as m:
            m.setattr(fake_quant, "quantize", counting)
            # 3 new tokens: a program of its own, traced here whatever ran before
            generate(params, cfg, PROMPTS, policy=policy, sampling=SamplingConfig(temperature=0.8),
                     max_new_tokens=3, num_samples=2, eos_id=EOS, loop=loop,
                     key=jax.random.PRNGKey(1), decode_layout="invariant", invariant_form=form)
        return weights, acts

    weights, acts = quantized_in_the_sampler(_form("columns"))
    assert weights == [] and len(acts) >= 8, (weights, acts)  # traced, activations only
    weights, _ = quantized_in_the_sampler(_form("row_chunks"))
    assert len(weights) >= 8, weights  # the 7 of a layer and the head, each step


def _lora(params, cfg, base_format: str, rank: int):
    """`params` as a LoRA run's forward reads them: the base held in `base_format`, adapters
    of `rank` moved off their init (B nonzero: they act)."""
    from jaxrl_lp.lora.adapters import hold_base, init_adapters, with_adapters
    from jaxrl_lp.lora.config import LoraConfig

    spec = LoraConfig(rank=rank, base_format=base_format)
    adapters = init_adapters(cfg, spec, jax.random.PRNGKey(3))
    adapters = jax.tree.map(lambda x: x + 0.02 * jax.random.normal(jax.random.PRNGKey(4),
                                                                   x.shape), adapters)
    return with_adapters(hold_base(params, base_format), adapters, spec.alpha / spec.rank)


@pytest.mark.parametrize(("policy", "base_format"), [
    ("fp32", "f32"),
    pytest.param("bf16", "mxfp4", marks=pytest.mark.slow),    # a QLoRA-style base
    pytest.param("mxfp8", "mxfp8", marks=pytest.mark.slow)])  # the base in the policy's format
def test_lora_adapters_give_the_learner_the_samplers_bits(policy, base_format, monkeypatch):
    """With LoRA weights (`W x + ((x A) B) s`, the unmerged sampler's) each of the three
    products takes the invariant form: the learner's forward of the adapted tree is the
    sampler's bits on the whole batch and its slices, as the replay is. The plant: the
    adapter's two products back to the plain form (`models.lora.adapter_product`), red at a
    rank whose products XLA:CPU sums by the row count (128 at this hidden size of 256)."""
    import jaxrl_lp.models.layers as layers
    from jaxrl_lp.models.lora import adapter_product

    policy = Policy.parse(policy)
    cfg, params, loop = _model("dense")
    lora = _lora(params, cfg, base_format, rank=128)
    ro = _rollout(cfg, lora, loop, policy)
    slices = [ro, take_rows(ro, np.arange(2)), take_rows(ro, np.arange(1))]
    program = jit_learner_logprobs(cfg, policy, "invariant")
    for r in slices:
        _exact(program(lora, r), r.logprobs, r, f"{r.completion_tokens.shape[0]} rows")
    _exact(replay_logprobs(lora, cfg, policy, ro), ro.logprobs, ro, "the replay")
    if base_format != "f32":
        return
    with monkeypatch.context() as m:
        m.setattr(layers, "_invariant_adapter", adapter_product)
        planted = jit_learner_logprobs(cfg, policy, "invariant")  # traced anew, planted
        assert sum(bit_mismatch(planted(lora, r), r.logprobs, r.completion_mask)[0]
                   for r in slices) > 0, "the adapter's products plain, yet every log-prob equal"


def _tile_places_hold() -> bool:
    """Whether Pallas's TPU interpreter gives a row of a fixed-tile product its bits at any
    place in its tile on this CPU (its tile products are XLA:CPU's)."""
    from jaxrl_lp.kernels.fixed_tile import fixed_tile_product

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((40, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 128)), jnp.bfloat16)
    full = np.asarray(fixed_tile_product(x, w, interpret="tpu"))
    moved = np.asarray(fixed_tile_product(jnp.roll(x, 7, 0), w, interpret="tpu"))
    return bool((np.roll(full, 7, 0).view(np.uint32) == moved.view(np.uint32)).all())


@pytest.mark.slow  # 95 s on 2 cores: CI's slow tier; the default suite keeps the tiles' model
@pytest.mark.ci  # wiring in test_fixed_tile.py (every product of a step and a forward the
# kernel's, counted) and their attention plant in the attention test's `fixed_tiles` cell
def test_fixed_tiles_give_the_learner_the_samplers_bits(monkeypatch):
    """Every product in `kernels.fixed_tile`'s fixed tiles (`InvariantForm.tiles`, the form a
    GPU or TPU would run compiled; here its TPU version interpreted): the learner's forward
    of the batch and of a slice is the sampler's bits, bf16, at widths where XLA's products
    are not (the test above). The plant: the learner's weight products back to XLA's plain
    product, breaks it (the attention's products, at this cache too short to tell, are
    planted in the attention's test above)."""
    import dataclasses

    import jaxrl_lp.numerics.invariant as inv
    from jaxrl_lp.kernels import KernelUnavailableError

    if not _tile_places_hold():
        pytest.skip("Pallas's TPU interpreter sums a row by its place in the tile on this CPU")
    policy = Policy.parse("bf16")
    cfg, params, loop = _model("dense")
    form = InvariantForm(0, None, "interpret-tpu")
    ro = _rollout(cfg, params, loop, policy, form=form)
    assert ro.invariant_form == form and ro.decode_layout == "invariant"
    program = jit_learner_logprobs(cfg, policy, "invariant")
    _exact(program(params, ro), ro.logprobs, ro, "whole batch")
    part = take_rows(ro, np.arange(2, 4))
    _exact(program(params, part), part.logprobs, part, "rows 2 and 3")
    three = take_rows(ro, np.arange(3))  # a shape not traced yet: the plants trace anew
    tiles = inv._fixed_tiles
    with monkeypatch.context() as m:
        m.setattr(inv, "_fixed_tiles", lambda form, x, w: (
            jnp.matmul(x, w, preferred_element_type=jnp.float32) if x.ndim == 2
            else tiles(form, x, w)))  # the weights' products XLA's, the attention's tiled
        planted = jit_learner_logprobs(cfg, policy, "invariant")(params, three)
        assert bit_mismatch(planted, three.logprobs, three.completion_mask)[0] > 0
    with pytest.raises(KernelUnavailableError, match="compiled versions for cuda .* only"):
        program(params, dataclasses.replace(ro, invariant_form=form._replace(tiles="compiled")))


WIDE = ["model.family=qwen3", "model.loop_steps=1", "model.hidden_size=256",
        "model.intermediate_size=512", "model.num_heads=4", "model.num_kv_heads=2",
        "model.head_dim=64", "model.num_layers=1", "model.max_position_embeddings=64",
        "sft.steps=2", "sft.batch_size=8", "grpo.steps=2", "grpo.prompts_per_step=4",
        "grpo.group_size=2", "grpo.max_new_tokens=6", "grpo.minibatches=2",
        "grpo.logprobs=invariant", "grpo.verify_every=1", "run.eval_size=4",
        "run.progress=false"]


def _two_steps_verified_and_nothing_replayed(out) -> None:
    """A run's two GRPO steps each verified (the learner's forward of the batch == the
    sampler's bits, 0.0 apart) and no update replayed the decode."""
    grpo = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in grpo if r["phase"] == "grpo"]
    assert len(grpo) == 2
    for r in grpo:
        assert r["replay_verified"] == 1.0 and r["mismatch_max_abs_dlogp"] == 0.0, r
        assert r["replayed_updates"] == 0.0, r


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    (), ("grpo.learner_policy=mxfp8", "grpo.sampler_policy=mxfp8"),  # the configs' policy
    ("lora.rank=8",)], ids=["fp32", "mxfp8", "lora"])
def test_a_run_with_auto_logprobs_takes_invariant_replays_no_update_and_verifies_exact(
        extra, tmp_path, capsys):
    """`jaxrl-lp train --set grpo.logprobs=auto` at four minibatches takes `invariant` (its
    forms serve the run; one line says so; config.json records it): the start probe and every
    step's
    verification pass (the learner's forward of the batch == the sampler's bits), and no
    update replays the decode (the later minibatches' values are their forwards). The same
    under MXFP8 products, and with LoRA adapters (from the first GRPO step)."""
    from helpers import sets

    from jaxrl_lp.cli.main import main

    out = tmp_path / "run"
    assert main(["train", *sets(*WIDE, f"run.out_dir={out}", "grpo.logprobs=auto",
                                "grpo.minibatches=4", *extra)]) == 0
    said = [x for x in capsys.readouterr().err.splitlines() if "grpo.logprobs=auto" in x]
    assert len(said) == 1 and said[0].startswith("jaxrl-lp train: grpo.logprobs=auto: "
                                                 "invariant ("), said
    assert json.loads((out / "config.json").read_text())["grpo"]["logprobs"] == "invariant"
    _two_steps_verified_and_nothing_replayed(out)


def test_compiled_tiles_on_a_gpu_need_bf16_policies_stored_natively(monkeypatch):
    """`grpo.invariant_tiles=compiled` on a GPU host (the backend stood in for): the GPU
    kernel multiplies bf16 or f16 arrays, so an f32 policy, bf16 carried in f32, or a quantized
    policy (f32 values of its codes) is one line naming the policy's key before anything is
    written; bf16 stored natively passes."""
    from jaxrl_lp.train import apply_overrides, default_config
    from jaxrl_lp.train.validate import _invariant_tiles

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    tiles = ["grpo.logprobs=invariant", "grpo.invariant_tiles=compiled"]
    cfg = lambda *sets: apply_overrides(default_config(), [*tiles, *sets])
    with pytest.raises(ValueError, match=r"^grpo.invariant_tiles=compiled: the GPU kernel "
                       r"multiplies bf16 or f16 arrays .* grpo.sampler_policy=\S+ computes in "
                       r"float32; set it to bf16"):
        _invariant_tiles(cfg(), None, None)
    with pytest.raises(ValueError, match=r"grpo.learner_policy=\S+ computes in bfloat16 stored "
                       r"in f32"):
        _invariant_tiles(cfg("grpo.sampler_policy=bf16", "grpo.learner_policy=bf16,s=f32"),
                         None, None)
    with pytest.raises(ValueError, match=r"grpo.sampler_policy=\S+ multiplies the f32 values of "
                       r"mxfp8 codes; set grpo.invariant_tiles=''"):
        _invariant_tiles(cfg("grpo.sampler_policy=mxfp8", "grpo.learner_policy=mxfp8"), None,
                         None)
    _invariant_tiles(cfg("grpo.sampler_policy=bf16", "grpo.learner_policy=bf16"), None, None)


@pytest.mark.slow
def test_a_run_in_fixed_tiles_verifies_every_step_and_replays_no_update(tmp_path, monkeypatch):
    """`grpo.logprobs=invariant grpo.invariant_tiles=interpret-tpu`: the sampler and the
    learner take every product in `kernels.fixed_tile`'s tiles (counted as they trace), the
    start probe and every step's verification find the learner's forward the sampler's bits,
    and no update replays the decode."""
    from helpers import sets

    import jaxrl_lp.numerics.invariant as inv
    import jaxrl_lp.rl.logprobs as logprobs
    from jaxrl_lp.cli.main import main

    traced, read = [], []
    tiles, check = inv._fixed_tiles, logprobs.check_invariant_rollout
    monkeypatch.setattr(inv, "_fixed_tiles", lambda form, x, w: (
        traced.append(form.tiles), tiles(form, x, w))[1])
    monkeypatch.setattr(logprobs, "check_invariant_rollout", lambda ro: (
        read.append(ro.invariant_form), check(ro))[1])
    out = tmp_path / "run"
    assert main(["train", *sets(*WIDE, f"run.out_dir={out}",
                                "grpo.invariant_tiles=interpret-tpu")]) == 0
    assert traced and set(traced) == {"interpret-tpu"}
    # the probe's rollout and the steps' (each traced program's): all sampled in the tiles
    assert read and set(read) == {InvariantForm(0, None, "interpret-tpu")}, set(read)
    _two_steps_verified_and_nothing_replayed(out)


def test_the_start_probe_stops_a_run_whose_learner_products_sum_otherwise(tmp_path, monkeypatch,
                                                                           capsys):
    """The plant in a run: the learner's weight products (not the sampler's, which would then
    sum alike: the test passed only after another run had compiled the sampler unplanted) sum
    their contraction in two halves
    (another order on every CPU; the plain form `x @ W` is another order on some CPUs only:
    on an AVX-512 one it sums a forward's rows as the invariant form does), the start probe
    finds its forward off the sampler's bits and stops with one line naming the invariant
    forward and `grpo.logprobs=hybrid`; nothing is written."""
    from helpers import sets

    import jaxrl_lp.numerics.invariant as inv
    import jaxrl_lp.rl.logprobs as logprobs
    from jaxrl_lp.cli.main import main

    dot, learner = inv.invariant_dot, logprobs._dense_logprobs

    def halves(x, w, policy):
        k = w.shape[0] // 2
        return dot(x[..., :k], w[:k], policy) + dot(x[..., k:], w[k:], policy)

    def planted_learner(*args):  # the plant while the learner's forward traces, not the sampler's
        inv.invariant_dot = halves
        try:
            return learner(*args)
        finally:
            inv.invariant_dot = dot

    monkeypatch.setattr(logprobs, "_dense_logprobs", planted_learner)
    out = tmp_path / "run"
    assert main(["train", *sets(*WIDE, f"run.out_dir={out}")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "grpo.start_probe" in err and "invariant forward" in err and \
        "grpo.logprobs=hybrid" in err and "nothing was written" in err, err
    assert not out.exists()


def test_invariant_logprobs_under_a_policy_scaled_by_a_mean_are_refused(tmp_path, capsys):
    """`grpo.logprobs=invariant` names a method the run must keep; under `ternary` (a scale
    that is a mean, summed in each program's order) the run stops before it writes anything,
    in one line naming the policy, `grpo.logprobs=hybrid` and the formats the forms take."""
    from helpers import sets

    from jaxrl_lp.cli.main import main

    out = tmp_path / "run"
    assert main(["train", *sets("grpo.logprobs=invariant", "grpo.learner_policy=mm=ternary",
                                "grpo.sampler_policy=mm=ternary", f"run.out_dir={out}")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "grpo.learner_policy=" in err and "ternary" in err and "grpo.logprobs=hybrid" in err \
        and "mxfp8" in err, err
    assert not out.exists()


def test_auto_takes_invariant_from_half_a_replay_an_iteration_where_its_forms_serve():
    """`grpo.logprobs=auto` (`train.logprobs_choice`): `invariant` from half a hybrid replay an
    iteration on average (later minibatches, epochs, a KL reference's log-probs, every
    verification; the races: the hybrid won at one minibatch, the invariant from two),
    `hybrid` below it (the recorded log-probs serve the updates) and wherever the forms do
    not serve the run, each with its reason; a named method is kept."""
    import dataclasses

    from jaxrl_lp.train import apply_overrides, default_config
    from jaxrl_lp.train.logprobs_choice import choose_logprobs, replays_per_iteration

    def cfg(*sets):
        return apply_overrides(default_config(), ["grpo.logprobs=auto", *sets])

    base = cfg()  # one minibatch, one epoch, verification every 10th step, no KL
    assert replays_per_iteration(base) == pytest.approx(0.1)
    assert choose_logprobs(base).method == "hybrid" and "0.1 times" in choose_logprobs(base).why
    for sets, replays in ((["grpo.minibatches=2"], 1.1), (["grpo.minibatches=4"], 3.1),
                          (["grpo.mu=2"], 1.1), (["loss.kl_beta=0.05"], 1.1),
                          (["grpo.verify_every=1"], 1.0)):
        assert replays_per_iteration(cfg(*sets)) == pytest.approx(replays), sets
        choice = choose_logprobs(cfg(*sets))
        assert choice.method == "invariant" and f"replay the decode {replays:.2g} times" in \
            choice.why, (sets, choice)
    four = cfg("grpo.minibatches=4")
    blocked = {
        "platform": (choose_logprobs(four, platform="cuda"), "XLA:CPU"),
        "multi-turn": (choose_logprobs(four, multiturn=True), "multi-turn"),
        "merged LoRA": (choose_logprobs(cfg("grpo.minibatches=4", "lora.rank=4",
                                            "lora.serve=merged")), "merged LoRA"),
        "off-policy": (choose_logprobs(cfg("grpo.minibatches=4", "grpo.max_staleness=1")),
                       "off-policy"),
        "policies": (choose_logprobs(cfg("grpo.minibatches=4", "grpo.sampler_policy=bf16")),
                     "other policies"),
        "a mean's scale": (choose_logprobs(cfg("grpo.minibatches=4",
                                                "grpo.learner_policy=mm=ternary",
                                                "grpo.sampler_policy=mm=ternary")), "ternary"),
    }
    for name, (choice, why) in blocked.items():
        assert choice.method == "hybrid" and why in choice.why, (name, choice)
    for fmt in ("fp8", "mxfp8", "nvfp4"):  # formats whose scales are maxima: the forms serve
        quantized = cfg("grpo.minibatches=4", f"grpo.learner_policy={fmt}",
                        f"grpo.sampler_policy={fmt}")
        assert choose_logprobs(quantized).method == "invariant", fmt
    assert choose_logprobs(cfg("grpo.minibatches=4", "lora.rank=4")).method == "invariant"
    for named in ("dense", "hybrid", "invariant"):
        named_cfg = dataclasses.replace(four, grpo=dataclasses.replace(four.grpo, logprobs=named))
        assert choose_logprobs(named_cfg) == (named, "")


@pytest.mark.parametrize("extra, method", [
    (("grpo.minibatches=1",), "hybrid"), (("lora.rank=4", "lora.serve=merged"), "hybrid"),
    (("lora.rank=4",), "invariant"), ((), "invariant")])
def test_jaxrl_lp_config_prints_auto_resolved(extra, method, capsys):
    """`jaxrl-lp config` prints the config a run would use: `grpo.logprobs=auto` resolved, and
    the plan's iteration counts follow the resolved method."""
    from jaxrl_lp.cli.main import main
    from jaxrl_lp.plan import iteration_updates
    from jaxrl_lp.train import apply_overrides, default_config

    minibatches = 1 if "grpo.minibatches=1" in extra else 4
    sets = ["grpo.logprobs=auto", f"grpo.minibatches={minibatches}", *extra]
    assert main(["config", *[x for s in sets for x in ("--set", s)]]) == 0
    assert json.loads(capsys.readouterr().out)["grpo"]["logprobs"] == method
    counts = iteration_updates(apply_overrides(default_config(), sets))
    want = ({"replaying": 0, "recorded": 1, "dense": minibatches - 1} if method == "invariant"
            else {"replaying": minibatches - 1, "recorded": 1})
    assert {k: counts[k] for k in want} == want, counts


def test_the_weights_major_form_pads_a_decodes_rows_least():
    """`form_for` takes the residue of `column_residues` that pads the decode's rows least
    (half a tile of rows to half a tile where that holds, two tiles to two), the probe's
    residues are the only ones a rollout may carry, and a form with a residue but no columns
    is refused in one line."""
    tile = column_tile()
    if tile is None or tile > MAX_COLUMN_TILE:
        pytest.skip(f"no column tile of at most {MAX_COLUMN_TILE} holds on this CPU")
    residues = column_residues()
    assert residues[0] == 0 and set(residues) <= {0, tile // 2}, residues
    for rows in (1, 2, 8, 12, tile, 24, 32, 34):
        form = form_for(rows)
        assert form.residue in residues
        assert padded_rows(rows, tile, form.residue) == min(
            padded_rows(rows, tile, r) for r in residues), (rows, form)
    if tile // 2 in residues:
        assert form_for(tile // 2).residue == tile // 2 and form_for(2 * tile).residue == 0
    # The product a decode of half a tile of rows runs: that many columns, no padding.
    half = form_for(tile // 2)
    with invariant_forms(opaque_zero(0), half):
        jaxpr = jax.make_jaxpr(weights_major_product)(jnp.ones((tile // 2, 64)),
                                                      jnp.ones((32, 64)))
    columns = [e.invars[1].aval.shape[0] for e in jaxpr.jaxpr.eqns
               if e.primitive.name == "dot_general"]
    assert columns == [padded_rows(tile // 2, tile, half.residue)], columns
    if tile // 2 in residues:
        assert columns == [tile // 2]
    assert [padded_rows(m, 16, 8) for m in (1, 8, 9, 256)] == [8, 8, 24, 264]
    assert [padded_rows(m, 16, 0) for m in (1, 16, 17)] == [16, 16, 32]
    odd = form_for(8)._replace(residue=tile // 2 - 1)
    assert "pads its weight products to" in form_holds(odd)
    with pytest.raises(ValueError, match="a residue is a count of rows under one column tile"):
        with invariant_forms(opaque_zero(0), InvariantForm(row_chunk(), None, residue=8)):
            pass
