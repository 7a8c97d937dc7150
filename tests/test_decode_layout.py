"""The decode's copy of the weights in the `transposed` layout (`rollout.step.decode_layout`).

- `dot` with a `TransposedWeight` is the product with the stored weight, to
  f32 rounding, with its gradient; lowered for CPU it keeps the weight as the
  product's row operand, for cuda and tpu it is one plain product.
- `unstack_layers(transpose=True)` copies exactly the plain matmul weights and
  the head `[out, in]` (a tied head is the embedding, no copy).
- The layout is chosen by where the weights are (CPU: `transposed`), and
  `as_stored` under a mesh, a matmul format or abstract weights; a layout
  that cannot apply is refused. The rollout records it and the replay
  follows it: replay == sampler bit for bit in either layout.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_lp.kernels.lowering import lower_for
from jaxrl_lp.models.blocks import MATMUL_WEIGHTS, lm_head, unstack_layers
from jaxrl_lp.models.config import get_preset
from jaxrl_lp.models.layers import TransposedWeight, dot
from jaxrl_lp.models.model import init_params
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rl.logprobs import replay_logprobs
from jaxrl_lp.rollout import SamplingConfig, generate
from jaxrl_lp.rollout.step import cpu_layout, decode_layout

F32 = Policy.parse("fp32")
CFG = get_preset("tiny-qwen3")
PROMPTS = [[5, 17, 3, 99, 42], [7, 81, 12]]


def _operands(rows=(8,), k=96, n=160):
    w = jax.random.normal(jax.random.PRNGKey(0), (k, n))
    x = jax.random.normal(jax.random.PRNGKey(1), (*rows, k))
    return x, w, TransposedWeight(jnp.asarray(w.T))


@pytest.mark.parametrize("rows", [(8,), (3, 1), (2, 5)])
def test_transposed_product_and_gradient_are_the_stored_ones(rows):
    x, w, tw = _operands(rows)
    f = jax.jit(lambda x, tw: dot(x, tw, F32))
    ref = np.asarray(dot(x, w, F32))
    got = np.asarray(f(x, tw))
    assert got.shape == ref.shape == (*rows, 160)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    g = jax.random.normal(jax.random.PRNGKey(2), ref.shape)
    dx, dwt = jax.grad(lambda x, tw: jnp.vdot(dot(x, tw, F32), g), (0, 1))(x, tw)
    dx_ref, dw_ref = jax.grad(lambda x, w: jnp.vdot(dot(x, w, F32), g), (0, 1))(x, w)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dwt.w_NxK, dw_ref.T, rtol=1e-5, atol=1e-4)


def test_transposed_product_is_refused_with_a_matmul_format():
    x, _, tw = _operands()
    with pytest.raises(ValueError, match="matmul_format"):
        dot(x, tw, Policy.parse("mxfp8"))


def test_lowered_per_platform():
    """CPU's program computes `[N, rows]` and transposes it; cuda's and tpu's one product."""
    x, _, tw = _operands()
    traced = jax.jit(lambda x, tw: dot(x, tw, F32)).trace(x, tw)
    text = {p: lower_for(traced, p) for p in ("cpu", "cuda", "tpu")}
    assert "tensor<160x8xf32>" in text["cpu"] and "optimization_barrier" in text["cpu"]
    for p in ("cuda", "tpu"):
        assert "tensor<160x8xf32>" not in text[p] and "optimization_barrier" not in text[p], p
        assert text[p].count("stablehlo.dot_general") == 1, p


@pytest.mark.parametrize("tied", [False, True])
def test_unstack_transposes_the_matmul_weights_and_the_head(tied):
    cfg = CFG.replace(tie_embeddings=tied)
    params = init_params(cfg, jax.random.PRNGKey(0))
    plain = unstack_layers(params)
    t = unstack_layers(params, transpose=True)
    assert len(t["layers"]) == cfg.num_layers
    for lp, lt in zip(plain["layers"], t["layers"], strict=True):
        assert set(lp) == set(lt)
        for k in lp:
            if k in MATMUL_WEIGHTS:
                assert isinstance(lt[k], TransposedWeight)
                np.testing.assert_array_equal(lt[k].w_NxK, np.asarray(lp[k]).T)
            else:
                np.testing.assert_array_equal(lt[k], lp[k])
    head = lm_head(t, cfg)
    assert isinstance(head, TransposedWeight)
    np.testing.assert_array_equal(head.w_NxK, np.asarray(lm_head(params, cfg)).T)
    if tied:
        assert head.w_NxK is params["embed"]  # the embedding itself, no copy
    assert unstack_layers(t, transpose=True) is t  # unstacked already: as they are


def test_the_layout_is_chosen_by_where_the_weights_are(monkeypatch):
    """CPU weights: `transposed` where the CPU's weights-major products run in column tiles of
    at most 16 (or none holds), `as_stored` where the tile is wider; elsewhere `as_stored`."""
    import jaxrl_lp.numerics.invariant as inv

    params = init_params(CFG, jax.random.PRNGKey(0))
    assert jax.devices()[0].platform == "cpu"
    tile = inv.column_tile()
    assert decode_layout(params, F32) == cpu_layout() == (
        "as_stored" if tile is not None and tile > inv.MAX_COLUMN_TILE else "transposed")
    for probed, layout in ((8, "transposed"), (16, "transposed"), (None, "transposed"),
                           (32, "as_stored"), (64, "as_stored")):
        with monkeypatch.context() as m:
            m.setattr(inv, "column_tile", lambda probed=probed: probed)
            assert decode_layout(params, F32) == layout, probed
    assert decode_layout(params, Policy.parse("mxfp8")) == "as_stored"
    mesh = jax.make_mesh((1,), ("data",))
    assert decode_layout(params, F32, mesh) == "as_stored"
    assert decode_layout(jax.eval_shape(lambda: params), F32) == "as_stored"
    traced = []
    jax.jit(lambda p: traced.append(decode_layout(p, F32)) or 0.0)(params)
    assert traced == ["as_stored"]  # inside another jit: no platform to read
    assert decode_layout(params, F32, layout="as_stored") == "as_stored"
    assert decode_layout(unstack_layers(params), F32) == "as_stored"
    assert decode_layout(unstack_layers(params, transpose=True), F32) == "transposed"
    with pytest.raises(ValueError, match="not one of"):
        decode_layout(params, F32, layout="columns")
    with pytest.raises(ValueError, match="one device and plain"):
        decode_layout(params, Policy.parse("mxfp8"), layout="transposed")
    with pytest.raises(ValueError, match="one device and plain"):
        decode_layout(params, F32, mesh, layout="transposed")


@pytest.mark.parametrize("layout", ["as_stored", "transposed"])
def test_the_rollout_records_its_layout_and_the_replay_follows_it(layout):
    params = init_params(CFG, jax.random.PRNGKey(0))
    ro = generate(params, CFG, PROMPTS, sampling=SamplingConfig(temperature=1.0),
                  max_new_tokens=12, num_samples=2, key=jax.random.PRNGKey(1),
                  decode_layout=layout)
    assert ro.decode_layout == layout
    replay = replay_logprobs(params, CFG, F32, ro)  # the sampler's program, tokens forced
    mask = np.asarray(ro.completion_mask) > 0
    assert (np.asarray(replay)[mask].view(np.uint32)
            == np.asarray(ro.logprobs)[mask].view(np.uint32)).all()
