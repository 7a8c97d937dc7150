"""Tests of the ternary export paths: code disagreement, the legacy quantizer, the fixed point."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_lp.models import get_preset, param_shapes
from jaxrl_lp.numerics import QArray, quantize
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.sync import (
    MATMUL_WEIGHTS,
    TERNARY_PATHS,
    SamplerState,
    code_disagreement,
    expected_layout,
    hash_served,
    legacy_ternary_quantize,
    run_sync_checks,
    ternary,
)

BF16 = jnp.bfloat16


def _latents(seed=0):
    """Realistic latents: normal(0, 0.02); stacked [L, in, out] weights and a [64, 128] head."""
    rng = np.random.default_rng(seed)
    shapes = {"q_proj": (4, 64, 64), "k_proj": (4, 64, 32), "v_proj": (4, 64, 32),
              "o_proj": (4, 64, 64), "gate_proj": (4, 64, 128), "up_proj": (4, 64, 128),
              "down_proj": (4, 128, 64)}
    assert set(shapes) == set(MATMUL_WEIGHTS)
    tree = {"layers": {k: rng.normal(0, 0.02, s) for k, s in shapes.items()},
            "lm_head": rng.normal(0, 0.02, (64, 128)), "final_norm": 1 + rng.normal(0, 0.05, 64)}
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


@pytest.fixture(scope="module")
def exported():
    lat = _latents()
    out = {}
    for path in TERNARY_PATHS:
        ex = ternary(path, include_lm_head=True)
        out[path] = jax.jit(ex.apply)(lat, ex.init(lat))[0]
    return lat, out


def test_code_disagreement_by_path(exported):
    lat, out = exported
    rates = {p: code_disagreement(lat, out[p], include_lm_head=True) for p in TERNARY_PATHS}
    print({p: {k: round(v, 5) for k, v in r.items()} for p, r in rates.items()})
    assert set(rates["direct_codes"]) == {f"layers/{n}" for n in MATMUL_WEIGHTS} | {"lm_head"}
    assert all(v == 0.0 for v in rates["direct_codes"].values())
    assert all(v == 0.0 for v in rates["bf16_fixed_point"].values())
    fixed_train = code_disagreement(lat, out["bf16_fixed_point"], consumer="training",
                                    include_lm_head=True)
    assert all(v == 0.0 for v in fixed_train.values())
    legacy = np.array(list(rates["bf16_then_quantize"].values()))
    # Measured: about 0.1% of codes (threshold elements at |W| ~ gamma / 2).
    assert legacy.max() > 0 and 1e-4 < legacy.mean() < 1e-2


def test_legacy_quantizer_matches_torch_bf16():
    torch = pytest.importorskip("torch")
    w = np.array(_latents(1)["layers"]["gate_proj"][0])  # writable, for torch
    codes, scale = legacy_ternary_quantize(jnp.asarray(w))
    # The Falcon-E / BitNet weight quantizer, run in bf16.
    t = torch.from_numpy(w).to(torch.bfloat16)
    s = 1.0 / t.abs().mean().clamp_(min=1e-5)
    tc = (t * s).round().clamp_(-1, 1)
    np.testing.assert_array_equal(np.asarray(codes), tc.to(torch.int8).numpy())
    assert float(scale.reshape(())) == float((1 / s).float())


def test_fixed_point_stays_near_bf16_latents(exported):
    lat, out = exported
    for name in ("gate_proj", "down_proj"):
        v = out["bf16_fixed_point"]["layers"][name]
        b = lat["layers"][name].astype(BF16)
        assert v.dtype == BF16
        steps = np.abs(np.asarray(jax.lax.bitcast_convert_type(v, jnp.int16), np.int32)
                       - np.asarray(jax.lax.bitcast_convert_type(b, jnp.int16), np.int32))
        print(name, "max ulps moved", steps.max(), "fraction moved", (steps > 0).mean())
        assert steps.max() <= 8 and (steps > 0).mean() < 0.01  # a few ulps, few elements


def test_ternary_scale_is_per_layer(exported):
    lat, out = exported
    q = out["direct_codes"]["layers"]["up_proj"]
    assert isinstance(q, QArray) and q.scales.shape == (4, 1, 1) and q.codes.dtype == jnp.int8
    for layer in range(4):
        w = lat["layers"]["up_proj"][layer]
        np.testing.assert_array_equal(q.scales[layer, 0, 0], jnp.mean(jnp.abs(w)))
        np.testing.assert_array_equal(q.codes[layer], quantize(w, "ternary").codes)
    assert out["direct_codes"]["final_norm"].tobytes() == lat["final_norm"].tobytes()


@pytest.mark.parametrize("path", TERNARY_PATHS)
def test_ternary_paths_pass_sync_checks(path):
    cfg = get_preset("tiny-qwen3")
    rng = np.random.default_rng(0)
    master = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.02, s), jnp.float32),
                          param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    ex = ternary(path)
    served, _ = jax.jit(ex.apply)(master, ex.init(master), 3)
    held = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), served)
    report = run_sync_checks(served, hash_served(served), SamplerState(held, 3, None, Policy.parse("bf16")),
                             expected_layout(ex, master), 3, master=master, cfg=cfg,
                             probe_tokens=rng.integers(0, cfg.vocab_size, (2, 8)),
                             learner_policy=Policy.parse("bf16"))
    assert report.passed, str(report)
