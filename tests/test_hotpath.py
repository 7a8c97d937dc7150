"""What the GPU's compiler is handed on the hot path (`plan.hotpath`, `jaxrl-lp bench hotpath`).

The decode loop reads the weights once rounded to the matmul inputs (bf16 when
stored natively, `models.blocks.decode_weights`), and the learner's products are
low-precision x low-precision (`numerics.products`), with the same log-probs
and, where the forward rounds, the same gradients as autodiff.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_lp.cli.main import main
from jaxrl_lp.models.blocks import decode_weights
from jaxrl_lp.models.config import get_preset
from jaxrl_lp.models.model import forward, init_params
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.numerics.products import product
from jaxrl_lp.plan.hotpath import dot_summary, dots, loop_weight_reads

BF16 = Policy.parse("bf16,s=native")  # stored as on a GPU or TPU


def test_the_reader_finds_a_loop_that_converts_its_weight_and_a_mixed_product():
    """The checks can fail: a loop rounding an f32 weight every step, an f32 x bf16 product."""
    w = jnp.ones((8, 4), jnp.float32)

    def per_step(w, x):
        body = lambda s: (s[0] + 1, s[1] + jnp.dot(s[1], w.astype(jnp.bfloat16).astype(jnp.float32)).sum())
        return jax.lax.while_loop(lambda s: s[0] < 3, body, (0, x))

    jaxpr = jax.make_jaxpr(per_step)(w, jnp.ones((8,), jnp.float32)).jaxpr
    reads = loop_weight_reads(jaxpr, "cuda", {(8, 4)})
    assert reads.weight_bytes == {"float32": 8 * 4 * 4}
    assert ("float32", "bfloat16", (8, 4)) in reads.converts

    mixed = jax.make_jaxpr(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))(
        jnp.ones((2, 8), jnp.float32), jnp.ones((8, 4), jnp.bfloat16)).jaxpr
    summary = dot_summary(dots(mixed, "cuda"))
    assert summary["mixed_flop_share"] == 1.0

    # The branch the platform runs, not the others.
    pick = lambda x, w: jax.lax.platform_dependent(
        x, w, cpu=lambda x, w: jnp.dot(x.astype(jnp.float32), w),
        default=lambda x, w: jnp.dot(x, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32))
    jaxpr = jax.make_jaxpr(pick)(jnp.ones((2, 8), jnp.bfloat16), w).jaxpr
    assert [(d.lhs, d.rhs) for d in dots(jaxpr, "cuda")] == [("bfloat16", "bfloat16")]
    assert [(d.lhs, d.rhs) for d in dots(jaxpr, "cpu")] == [("float32", "float32")]


def test_a_product_in_a_scan_counts_once_a_trip():
    """A layer scan's product runs once a layer: its FLOPs are the scan's length times one's,
    nested scans multiplying (a `while` body counts once, for one iteration)."""
    x, ws = jnp.ones((2, 8)), jnp.ones((3, 5, 8, 8))
    one = 2 * 2 * 8 * 8

    def layers(x, ws):
        inner = lambda h, w: (h @ w, None)
        return jax.lax.scan(lambda h, w5: (jax.lax.scan(inner, h, w5)[0], None), x, ws)[0]

    (d,) = dots(jax.make_jaxpr(layers)(x, ws).jaxpr, "cuda")
    assert d.flops == 3 * 5 * one and not d.in_loop
    body = lambda s: (s[0] + 1, s[1] @ s[2], s[2])
    loop = jax.make_jaxpr(lambda x, w: jax.lax.while_loop(lambda s: s[0] < 7, body, (0, x, w)))
    (d,) = dots(loop(x, ws[0, 0]).jaxpr, "cuda")
    assert d.flops == one and d.in_loop


def test_the_platform_branch_is_taken_where_its_index_comes_from_outside_the_scan():
    """Differentiated, a scanned `platform_dependent` reads an index computed outside the
    scans (the loop-invariant `platform_index`, hoisted): still cuda's branch only."""
    def f(x, ws):
        body = lambda h, w: (jax.lax.platform_dependent(
            h, w, cpu=lambda h, w: h @ w,
            default=lambda h, w: jnp.dot(h.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                                         preferred_element_type=jnp.float32)), None)
        return jax.lax.scan(body, x, ws)[0].sum()

    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=1))(jnp.ones((2, 8)), jnp.ones((3, 8, 8))).jaxpr
    found = [(d.lhs, d.rhs) for d in dots(jaxpr, "cuda")]
    assert len(found) == 3 and ("float32", "float32") not in found, found  # cpu's: f32 x f32


def test_bench_hotpath_finds_bf16_reads_and_bf16_products(tmp_path, capsys):
    out = tmp_path / "hotpath.json"
    assert main(["bench", "hotpath", "--presets", "tiny-qwen3,tiny-ouro", "--policies",
                 "bf16,fp32", "--rows", "2", "--prompt-len", "16", "--new-tokens", "8",
                 "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["ok"] is True and len(got["cells"]) == 4
    for cell in got["cells"]:
        samp = cell["sampler"]
        assert samp["loop_weight_converts"] == [], cell["preset"]
        want = "bfloat16" if cell["policy"] == "bf16" else "float32"
        assert set(samp["loop_weight_bytes"]) == {want}
        for name in ("grpo_step_dense", "grpo_step_hybrid"):
            products = cell[name]["products"]
            key = ("bfloat16 x bfloat16 DEFAULT" if cell["policy"] == "bf16"
                   else "float32 x float32 HIGHEST")
            assert key in products and cell[name]["mixed_flop_share"] == 0.0, (cell, name)
    assert main(["bench", "hotpath", "--presets", "tiny-qwen3", "--rows", "0"]) == 2
    assert "--rows must be >= 1" in capsys.readouterr().err


def test_bench_hotpath_refuses_a_bad_plugin_target_remat_or_platform(tmp_path, capsys,
                                                                      monkeypatch):
    """The compiled cells' options: each bad value one line and exit 2, before anything runs."""
    monkeypatch.delenv("JAXRL_LP_CUDA_PLUGIN", raising=False)
    base = ["bench", "hotpath", "--presets", "tiny-qwen3", "--policies", "bf16"]
    assert main([*base, "--cuda-plugin", str(tmp_path)]) == 2
    assert "no jax_plugins/xla_cuda*/xla_cuda_plugin.so there" in capsys.readouterr().err
    plugin = tmp_path / "jax_plugins" / "xla_cuda12"
    plugin.mkdir(parents=True)
    (plugin / "xla_cuda_plugin.so").write_bytes(b"")
    assert main([*base, "--cuda-plugin", str(tmp_path), "--platform", "cpu"]) == 2
    assert "--cuda-plugin compiles for a GPU" in capsys.readouterr().err
    assert main([*base, "--target", "a100"]) == 2
    assert "--target must be one of h100, h200; got 'a100'" in capsys.readouterr().err
    assert main([*base, "--remat", "dots,attention"]) == 2
    assert "--remat: remat must be one of ['none', 'layers', 'dots']" in capsys.readouterr().err


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-ouro"])
def test_decode_weights_are_bf16_and_the_forward_is_the_same_bits(preset):
    cfg = get_preset(preset)
    params = init_params(cfg, jax.random.PRNGKey(0))
    copy = decode_weights(params, BF16)
    assert copy["layers"]["q_proj"].dtype == jnp.bfloat16 and copy["embed"].dtype == jnp.bfloat16
    if cfg.is_looped:  # the gate's bias is read in f32: kept
        assert copy["exit_gate"]["bias"].dtype == jnp.float32
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, cfg.vocab_size)
    run = jax.jit(lambda p: forward(p, cfg, BF16, tokens)[0])
    np.testing.assert_array_equal(np.asarray(run(copy)), np.asarray(run(params)))
    # f16 params under bf16 compute would round twice: left as they are.
    other = Policy.parse("p=f16,c=bf16,s=native")
    assert decode_weights(params, other) is params


def test_product_backward_multiplies_bf16_and_rounds_the_cotangent():
    """Where the forward rounds its accumulator, the gradient is autodiff's bit for bit; where
    the accumulator is read in f32, the backward multiplies the cotangent rounded to bf16."""
    kx, kw, kc = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (6, 16), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (16, 8), jnp.float32).astype(jnp.bfloat16)
    c = jax.random.normal(kc, (6, 8), jnp.float32)
    plain = lambda x, w: jnp.einsum("tk,kn->tn", x, w, preferred_element_type=jnp.float32)

    def rounded(prod):
        return lambda x, w: jnp.sum(BF16.round(prod(x, w)).astype(jnp.float32) * c)

    ours = jax.grad(rounded(lambda x, w: product("tk,kn->tn", x, w, BF16)), (0, 1))(x, w)
    autodiff = jax.grad(rounded(plain), (0, 1))(x, w)
    for a, b in zip(ours, autodiff, strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    # The backward's products are bf16 x bf16 (autodiff's: the f32 cotangent x bf16).
    traced = jax.make_jaxpr(jax.grad(rounded(lambda x, w: product("tk,kn->tn", x, w, BF16))))
    assert dot_summary(dots(traced(x, w).jaxpr, "cuda"))["mixed_flop_share"] == 0.0
    traced = jax.make_jaxpr(jax.grad(rounded(plain)))
    assert dot_summary(dots(traced(x, w).jaxpr, "cuda"))["mixed_flop_share"] > 0.0

    # Read in f32: dx = bf16(c) @ w.T, rounded to bf16.
    dx = jax.grad(lambda x: jnp.sum(product("tk,kn->tn", x, w, BF16) * c))(x)
    want = jnp.dot(c.astype(jnp.bfloat16).astype(jnp.float32), w.astype(jnp.float32).T,
                   precision="highest").astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(want, np.float32))
    exact = jnp.dot(c, w.astype(jnp.float32).T, precision="highest").astype(jnp.bfloat16)
    assert not np.array_equal(np.asarray(dx, np.float32), np.asarray(exact, np.float32))


def test_the_low_precision_backward_traces_no_forward_product_again():
    """Two products in the backward, none more: a backward through `jax.vjp` traced the
    forward product again (dead, but counted by `plan.hotpath`)."""
    a, b = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 2), jnp.bfloat16)
    grad = jax.grad(lambda a, b: product("ij,jk->ik", a, b, BF16).sum(), argnums=(0, 1))
    assert len(dots(jax.make_jaxpr(grad)(a, b).jaxpr, "cuda")) == 3  # forward, da, db
