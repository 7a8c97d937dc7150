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
            kernels=rng.choice(("auto", "off", "interpret")),
            storage=rng.choice(("auto", "native", "f32")),
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
        ("bf16,s=bf16", ["storage", "'bf16'", "native", "f32"]),  # unknown storage
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


def test_storage_is_the_policys_and_auto_follows_the_backend():
    """Storage is a field: `native` stores bf16 arrays, `f32` the carrier, `auto` the backend's
    choice (the f32 carrier on CPU); the rounded values are the same."""
    x = jnp.asarray([1 + 2**-8, 3.14159, -2.5e-3], jnp.float32)
    native, carried = Policy.parse("bf16,s=native"), Policy.parse("bf16,s=f32")
    assert native.native and not carried.native
    assert (native.carrier_dtype, carried.carrier_dtype) == (jnp.bfloat16, jnp.float32)
    assert PRESETS["bf16"].native == (jax.default_backend() != "cpu")
    assert native.round(x).dtype == jnp.bfloat16 and carried.round(x).dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(native.round(x), np.float32),
                                  np.asarray(carried.round(x)))
    assert not Policy.parse("fp32,s=native").is_low_precision  # f32 stays f32 either way
    assert Policy.parse("fp32,s=native").carrier_dtype == jnp.float32
    assert str(PRESETS["bf16"]) == str(Policy.parse("bf16,s=auto"))  # the default is left out
    assert native != PRESETS["bf16"]  # a different program: not the same policy


def test_name_and_repr_read_back():
    assert PRESETS["bf16"].name == "bf16" and Policy.parse("c=bf16").name == "bf16"
    odd = Policy.parse("bf16,k=off")
    assert odd.name == str(odd) and Policy.parse(odd.name) == odd
    assert eval(repr(odd), {"Policy": Policy}) == odd


def test_functions_below_the_boundary_refuse_a_string_naming_the_fix():
    from jaxrl_lp.models.config import get_preset
    from jaxrl_lp.models.model import forward, init_params
    from jaxrl_lp.numerics import require
    from jaxrl_lp.rollout import generate

    cfg = get_preset("tiny-qwen3")
    params = init_params(cfg, jax.random.PRNGKey(0))
    with pytest.raises(TypeError, match=r"generate: the policy is the string 'bf16'; pass a "
                                        r"Policy, .*Policy.parse\('bf16'\)"):
        generate(params, cfg, [[1, 2]], policy="bf16", max_new_tokens=2)
    with pytest.raises(TypeError, match=r"^forward: the policy is the string 'fp32'"):
        forward(params, cfg, "fp32", jnp.ones((1, 3), jnp.int32))
    with pytest.raises(TypeError, match="must be a Policy; got int"):
        require(3, "here")
    assert require(PRESETS["fp32"], "here") is PRESETS["fp32"]


def test_a_rollout_refuses_a_policy_string_where_it_is_built():
    # Before: `Rollout(policy="fp32")` was built, and the GRPO step refused it later with
    # "sampled under policy 'p=f32,...' but this learner step was built for rollouts of
    # 'p=f32,...'".
    import dataclasses

    from jaxrl_lp.rollout import Rollout

    rows = dict(prompt_tokens=jnp.ones((2, 3), jnp.int32), prompt_lengths=jnp.full((2,), 3),
                completion_tokens=jnp.ones((2, 4), jnp.int32), completion_mask=jnp.ones((2, 4)),
                logprobs=jnp.zeros((2, 4)), exit_steps=jnp.zeros((2, 4), jnp.int32),
                loop_evals=jnp.int32(0), weights_version=jnp.int32(0))
    with pytest.raises(TypeError, match=r"^Rollout: the policy is the string 'fp32'; pass a "
                                        r"Policy, .*Policy.parse\('fp32'\)"):
        Rollout(**rows, policy="fp32")
    ro = Rollout(**rows, policy=PRESETS["bf16"])
    with pytest.raises(TypeError, match=r"^Rollout: .*Policy.parse\('bf16'\)"):
        dataclasses.replace(ro, policy="bf16")
    # The check is static: a rollout still crosses `jit` (flattened and rebuilt).
    assert jax.jit(lambda r: r)(ro).policy is PRESETS["bf16"]


def test_the_retired_storage_switch_names_its_replacement():
    import subprocess
    import sys

    env = {"JAX_PLATFORMS": "cpu", "JAXRL_LP_NATIVE_LOW_PRECISION": "1",
           "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", "import jaxrl_lp.numerics"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "add s=native" in r.stderr.splitlines()[-1], r.stderr[-500:]
    import jaxrl_lp.numerics as numerics

    with pytest.raises(AttributeError, match="Policy.native"):
        numerics.native_low_precision  # noqa: B018


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


def test_a_list_of_policies_takes_presets_by_commas_and_any_policy_by_semicolons():
    import argparse

    from jaxrl_lp.numerics.policy import policy_list_arg

    assert policy_list_arg("bf16,fp32") == (Policy.parse("bf16"), Policy.parse("fp32"))
    fresh = Policy.parse("fp8,bwd=fresh")
    assert fresh.backward == "fresh"
    assert policy_list_arg("fp8;fp8,bwd=fresh") == (Policy.parse("fp8"), fresh)
    with pytest.raises(argparse.ArgumentTypeError, match="separate policies of any form by ';'"):
        policy_list_arg("fp8,bwd=fresh")  # by commas: "fp8" and "bwd=fresh" over the default
