"""Tests of the precision policy: string form, validation messages, rounding."""

import random

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrl_lp.numerics import ALL_REGIONS, MATMUL_FORMATS, PRESETS, Policy, round_nearest

DTYPES = ("f32", "bf16", "f16")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip(name):
    p = Policy.parse(name)
    assert p is PRESETS[name]
    assert Policy.parse(str(p)) == p
    assert Policy.parse(p.to_string()) == p


def test_random_combinations_round_trip():
    rng = random.Random(0)
    for _ in range(200):
        regions = frozenset(r for r in ALL_REGIONS if rng.random() < 0.5)
        p = Policy(
            param_dtype=rng.choice(DTYPES),
            compute_dtype=rng.choice(DTYPES),
            logits_dtype=rng.choice(DTYPES),
            f32_regions=regions,
            matmul_format=rng.choice((None, *MATMUL_FORMATS)),
            backward=rng.choice(("reuse", "fresh")),
        )
        s = str(p)
        assert Policy.parse(s) == p, s
        assert str(Policy.parse(s)) == s


def test_unspecified_keys_take_defaults():
    assert Policy.parse("c=bf16") == PRESETS["bf16"]
    assert Policy.parse("p=f32,c=bf16,mm=none,bwd=reuse") == PRESETS["bf16"]


@pytest.mark.parametrize(
    "spec, must_name",
    [
        ("bf17", ["preset", "bf16", "mxfp8"]),  # unknown preset: lists the presets
        ("p=f32,zz=1", ["'zz'", "allowed", "'bwd'", "'mm'"]),  # unknown key
        ("f32=rope+foo", ["f32_regions", "'foo'", "rope", "softmax"]),  # unknown region
        ("c=f8", ["compute_dtype", "'f8'", "bf16", "f16", "f32"]),  # unknown dtype
        ("p=int8", ["param_dtype", "bf16"]),
        ("bwd=later", ["backward", "'later'", "reuse", "fresh"]),  # unknown backward
        ("mm=int3", ["matmul_format", "'int3'", "mxfp8", "ternary"]),  # unknown format
        ("p=f32,c", ["'c'", "key=value"]),
    ],
)
def test_invalid_specs_name_the_field_and_allowed_values(spec, must_name):
    with pytest.raises(ValueError) as e:
        Policy.parse(spec)
    for word in must_name:
        assert word in str(e.value), (word, str(e.value))


def test_constructor_validates():
    with pytest.raises(ValueError, match="backward"):
        Policy(backward="sometimes")
    with pytest.raises(ValueError, match="accum_dtype"):
        Policy(accum_dtype="bf16")
    with pytest.raises(ValueError, match="f32_regions"):
        Policy(f32_regions=frozenset({"attention"}))


def test_round_gives_bf16_values():
    p = PRESETS["bf16"]
    x = jax.random.normal(jax.random.key(0), (512,), jnp.float32) * 3.0
    y = jax.jit(p.round)(x)
    assert y.dtype == p.carrier_dtype
    y32 = np.asarray(y.astype(jnp.float32))
    # On the bf16 grid: a second rounding changes nothing.
    np.testing.assert_array_equal(y32.astype(ml_dtypes.bfloat16).astype(np.float32), y32)
    # And it is round to nearest even, i.e. the ml_dtypes cast.
    np.testing.assert_array_equal(y32, np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(y32, np.asarray(round_nearest(x, "bf16").astype(jnp.float32)))
    assert not np.array_equal(y32, np.asarray(x))  # random f32 values are not all on the grid


def test_round_f32_is_identity_and_fp16_rounds_to_half():
    x = jax.random.normal(jax.random.key(1), (256,), jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(PRESETS["fp32"].round)(x)), np.asarray(x))
    y = np.asarray(jax.jit(PRESETS["fp16"].round)(x).astype(jnp.float32))
    np.testing.assert_array_equal(y, np.asarray(x).astype(np.float16).astype(np.float32))


def test_cast_params_touches_floating_leaves_only():
    p = Policy(param_dtype="bf16")
    tree = {"w": jnp.ones((2, 2), jnp.float32), "ids": jnp.arange(3, dtype=jnp.int32)}
    out = p.cast_params(tree)
    assert out["w"].dtype == jnp.bfloat16
    assert out["ids"].dtype == jnp.int32
