"""The error-diffusion optimizer (`jaxrl_lp.optim`): invariants, errors, training by config."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import short_run

from jaxrl_lp.cli.main import main as cli_main
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.model import init_params
from jaxrl_lp.optim import (
    CodedWeights,
    LatentSTEWeights,
    OptimizerSpec,
    error_diffusion,
    partition,
    residual_range,
)
from jaxrl_lp.train import apply_overrides, default_config, run_train

TINY = ModelConfig(family="ouro", vocab_size=20, hidden_size=32, num_layers=1, num_heads=2,
                   num_kv_heads=1, head_dim=16, intermediate_size=64, loop_steps=2,
                   max_position_embeddings=32)


def test_a_flip_keeps_the_excess_exactly():
    """Hand-computed: k=4 (T=8, residual in [-8, 7]), lr 0.25, raw gradient, nearest rounding,
    so the increment is -0.25 * 8 * g = -2g quanta."""
    tx = error_diffusion(0.25, levels="binary", k=4, normalize=None, rounding="nearest")
    codes = {"w": jnp.array([1, 1, -1, 1, -1], jnp.int8)}
    state = tx.init(codes)._replace(residual={"w": jnp.array([-6, 7, 0, 3, 7], jnp.int8)})
    g = {"w": jnp.array([2.5, -4.0, 1.0, 0.5, -0.5], jnp.float32)}
    delta, new = jax.jit(tx.update)(g, state, codes)
    # w0: -6 - 5 = -11 <= -8: flips to -1 and keeps -11 + 8 = -3.
    # w1: 7 + 8 = 15 asks to go up from +1: impossible, saturates at 7.
    # w2: 0 - 2 = -2, no flip.  w3: 3 - 1 = 2.  w4: 7 + 1 = 8 >= 8: -1 -> +1, keeps 0.
    np.testing.assert_array_equal(delta["w"], [-2, 0, 0, 0, 2])
    np.testing.assert_array_equal(new.residual["w"], [-3, 7, -2, 2, 0])
    np.testing.assert_array_equal(optax.apply_updates(codes, delta)["w"], [-1, 1, -1, 1, 1])
    assert delta["w"].dtype == jnp.int8 and new.residual["w"].dtype == jnp.int8


def test_ternary_moves_one_level_at_a_time():
    tx = error_diffusion(1.0, levels="ternary", k=2, normalize=None, rounding="nearest")
    codes = {"w": jnp.array([-1, 0, 1, 0], jnp.int8)}
    state = tx.init(codes)  # T = 2, residual in [-2, 1]
    delta, new = tx.update({"w": jnp.array([-1.0, -1.0, 1.0, 2.5])}, state, codes)
    # increments -2g = 2, 2, -2, -5: -1 -> 0, 0 -> 1, 1 -> 0, 0 -> -1 keeping -5 + 2 = -3 -> -2.
    np.testing.assert_array_equal(delta["w"], [1, 1, -1, -1])
    np.testing.assert_array_equal(new.residual["w"], [0, 0, 0, -2])


@pytest.mark.parametrize("levels", ["binary", "ternary"])
@pytest.mark.parametrize("k", [2, 8])
def test_dtypes_levels_and_residual_range_hold_over_many_steps(levels, k):
    tx = error_diffusion(0.3, levels=levels, k=k, seed=k)
    key = jax.random.PRNGKey(0)
    codes = {"a": jnp.where(jax.random.normal(key, (16, 8)) > 0, 1, -1).astype(jnp.int8),
             "b": jnp.ones((3, 4, 5), jnp.int8)}
    state = tx.init(codes)
    update = jax.jit(tx.update)
    lo, hi = residual_range(k)
    allowed = [-1, 1] if levels == "binary" else [-1, 0, 1]
    for i in range(10):
        g = jax.tree.map(lambda c, i=i: jax.random.normal(jax.random.PRNGKey(i), c.shape), codes)
        delta, state = update(g, state, codes)
        codes = optax.apply_updates(codes, delta)
        for c, r in zip(jax.tree.leaves(codes), jax.tree.leaves(state.residual), strict=True):
            assert c.dtype == jnp.int8 and r.dtype == jnp.int8
            assert set(np.unique(np.asarray(c))) <= set(allowed)
            assert lo <= int(r.min()) and int(r.max()) <= hi
    assert int(state.count) == 10


def test_no_recompile_on_the_second_call():
    tx = error_diffusion(0.1, levels="binary", k=4)
    codes = {"w": jnp.ones((4, 4), jnp.int8)}
    traces = []

    @jax.jit
    def step(g, s, c):
        traces.append(1)
        d, s = tx.update(g, s, c)
        return optax.apply_updates(c, d), s

    state = tx.init(codes)
    for i in range(3):
        codes, state = step({"w": jnp.full((4, 4), float(i + 1))}, state, codes)
    assert len(traces) == 1


@pytest.mark.parametrize("k", [1, 9, 0, 2.5])
def test_k_outside_2_to_8_is_one_clear_error(k):
    with pytest.raises(ValueError, match=r"from 2 to 8 bits.*choose e\.g\. k=4"):
        error_diffusion(0.1, k=k)


@pytest.mark.parametrize("k", ["1", "9"])
def test_k_outside_2_to_8_in_the_config_names_the_key(k, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"^sft\.optimizer='error_diffusion:binary:k=\d'.*2 to 8"):
        apply_overrides(default_config(), [f"sft.optimizer=error_diffusion:binary:k={k}"])
    assert cli_main(["sft", "--set", f"run.out_dir={tmp_path / 'r'}", "--set",
                     f"sft.optimizer=error_diffusion:binary:k={k}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "sft.optimizer" in err and "\n" not in err
    assert not (tmp_path / "r").exists()


def test_an_unassigned_parameter_is_one_clear_error():
    params = {"embed": jnp.zeros((3, 2)), "layers": {"q_proj": jnp.ones((1, 2, 2), jnp.int8)}}
    tx = partition({"codes": error_diffusion(0.1), "adam": optax.adam(1e-3)},
                   lambda p: "codes" if p == "layers/q_proj" else None)
    with pytest.raises(ValueError, match=r"leaves parameter 'embed' unassigned.*add a rule"):
        tx.init(params)
    tx = partition({"codes": error_diffusion(0.1)},
                   lambda p: "codes" if p == "layers/q_proj" else "adam")
    with pytest.raises(ValueError, match=r"'embed' to 'adam', which has no transform"):
        tx.init(params)


def test_coded_weights_with_adam_by_multi_transform():
    params = init_params(TINY, jax.random.PRNGKey(0))
    weights = CodedWeights("ternary")
    train = weights.from_params(params)
    q = train["layers"]["q_proj"]
    assert q["codes"].dtype == jnp.int8 and q["scale"].shape == (1, 1, 32)
    assert set(np.unique(np.asarray(q["codes"]))) <= {-1, 0, 1}
    tx = OptimizerSpec.parse("error_diffusion:ternary:k=4:lr=1.5").transform(optax.adam(1e-2))
    state = tx.init(train)

    def loss(d):
        p = weights.model_params(d)
        return sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(p))

    @jax.jit
    def step(train, state):
        g = jax.grad(loss)(weights.differentiable(train))
        u, state = tx.update(g, state, train)
        return optax.apply_updates(train, u), state

    new, state = step(train, state)
    for old_leaf, new_leaf in zip(jax.tree.leaves(train), jax.tree.leaves(new), strict=True):
        assert old_leaf.dtype == new_leaf.dtype
    assert float(weights.flip_rate(train, new)) > 0  # 1.5 levels per unit step: codes move
    assert not np.array_equal(new["embed"], train["embed"])  # Adam moved the f32 leaves
    assert not np.array_equal(new["layers"]["q_proj"]["scale"], q["scale"])
    # The materialized weight is codes * scale, f32, the model's shape.
    m = weights.materialize(new)
    assert m["layers"]["q_proj"].dtype == jnp.float32
    assert m["layers"]["q_proj"].shape == params["layers"]["q_proj"].shape


def test_latent_ste_forward_is_quantized_and_gradient_straight_through():
    params = init_params(TINY, jax.random.PRNGKey(1))
    w = LatentSTEWeights("binary")
    m = w.materialize(params)["layers"]["up_proj"]
    assert len(np.unique(np.abs(np.asarray(m[0])))) == 1  # one magnitude per layer: mean|W|
    g = jax.grad(lambda p: jnp.sum(w.model_params(p)["layers"]["up_proj"] * 3.0))(params)
    np.testing.assert_array_equal(g["layers"]["up_proj"], 3.0)


@pytest.mark.parametrize("text", ["adamw", "error_diffusion:binary:k=8:lr=0.05",
                                  "error_diffusion:ternary:k=2:lr=0.2", "latent_ste:ternary"])
def test_spec_string_round_trips(text):
    assert str(OptimizerSpec.parse(text)) == text


def _cfg(out, *extra):
    return apply_overrides(default_config(), [
        *short_run(sft_steps=8, grpo_steps=2, checkpoint_every=3), "sft.lr=1e-2",
        "sft.optimizer=error_diffusion:binary:k=4", "task.max_digits=1", "run.eval_size=4",
        "run.keep_checkpoints=5", f"run.out_dir={out}", *extra])


def _restore(cfg):
    from jaxrl_lp.studies.common import restore_state

    return restore_state(cfg)[0]


@pytest.mark.slow  # the slow tier (22 s cold): tests/test_convert.py runs the command by default
def test_convert_writes_a_binary_runs_materialized_weights(tmp_path):
    """`convert run-to-hf` of an error-diffusion run writes `codes * scale`, not its train tree."""
    from jaxrl_lp.models.hf_config import read_hf_config
    from jaxrl_lp.models.hf_io import load_hf_params
    from jaxrl_lp.train.convert import run_to_hf

    run_train(_cfg(tmp_path / "run", "sft.steps=3", "grpo.steps=0"))
    state = _restore(_cfg(tmp_path / "run", "sft.steps=3", "grpo.steps=0"))
    assert state["params"]["layers"]["q_proj"]["codes"].dtype == jnp.int8
    run_to_hf(tmp_path / "run", tmp_path / "hf")
    hf = load_hf_params(tmp_path / "hf", read_hf_config(tmp_path / "hf"))
    want = CodedWeights("binary").materialize(state["params"])
    for name in ("q_proj", "down_proj"):
        np.testing.assert_array_equal(np.asarray(hf["layers"][name]),
                                      np.asarray(want["layers"][name]))


@pytest.mark.slow
# 18 s with a warm compilation cache, 82 s cold; the study test below
# covers error diffusion by config (warm-start) in the default suite
def test_sft_then_grpo_by_config_trains_and_resumes_exactly(tmp_path):
    """A binary run (8 warm-start steps, 2 GRPO steps): its loss falls, its int8 codes are
    checkpointed, and a run interrupted at step 5 and resumed ends bit for bit the same."""
    full = _cfg(tmp_path / "full")
    summary = run_train(full)
    assert summary["steps"] == 10 and 0.0 <= summary["final_accuracy"] <= 1.0
    recs = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    sft = [r for r in recs if r.get("phase") == "sft"]
    assert len(sft) == 8 and sft[-1]["loss"] < sft[0]["loss"] - 0.5
    assert all(0.0 <= r["flip_rate"] <= 1.0 for r in sft)
    assert any(r.get("phase") == "grpo" and "flip_rate" in r for r in recs)

    part = _cfg(tmp_path / "part")
    assert run_train(part, stop_after=5)["interrupted"]
    run_train(part)
    a, b = _restore(full), _restore(part)
    codes = a["params"]["layers"]["q_proj"]["codes"]
    assert codes.dtype == jnp.int8
    assert set(np.unique(np.asarray(codes))) <= {-1, 1}
    residual = [x for x in jax.tree.leaves(a["opt_sft"]) if x.dtype == jnp.int8]
    assert residual, "the error-diffusion residual is checkpointed"
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # `convert run-to-hf` writes the model's weights (codes * scale), not the train tree.
    from jaxrl_lp.models.hf_config import read_hf_config
    from jaxrl_lp.models.hf_io import load_hf_params
    from jaxrl_lp.train.convert import run_to_hf

    run_to_hf(tmp_path / "full", tmp_path / "hf")
    hf = load_hf_params(tmp_path / "hf", read_hf_config(tmp_path / "hf"))
    want = CodedWeights("binary").materialize(a["params"])
    np.testing.assert_array_equal(np.asarray(hf["layers"]["q_proj"]),
                                  np.asarray(want["layers"]["q_proj"]))


@pytest.mark.slow
@pytest.mark.ci
def test_study_error_diffusion_quick_runs_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "study"
    assert cli_main(["study", "error-diffusion", "--quick", "--out", str(out), "--sft-steps", "6",
                     "--arms", "latent_binary,ed_binary_k2", "--set", "run.eval_size=4"]) == 0
    printed = json.loads(capsys.readouterr().out)
    arms = printed["arms"]
    assert set(arms) == {"latent_binary", "ed_binary_k2"}
    assert arms["ed_binary_k2"]["bits_per_weight"] == 3.0
    assert arms["latent_binary"]["bits_per_weight"] == 96.0
    assert "loss_vs_latent" in arms["ed_binary_k2"]
    for name in ("error_diffusion.json", "loss.png", "flip_rate.png"):
        assert (out / name).stat().st_size > 0
    assert len(json.loads((out / "error_diffusion.json").read_text())["series"]
               ["ed_binary_k2"]["flip_rate"]) == 6


@pytest.mark.slow
@pytest.mark.parametrize("levels, k", [("binary", 4), ("ternary", 4)])
def test_error_diffusion_within_10pct_of_the_latent_baseline_at_the_default_size(
        tmp_path, levels, k):
    """The default model and task, the full warm-start: error diffusion with at most 9 bits
    of training state per weight ends within 10% of the 96-bit latent baseline's loss."""
    from jaxrl_lp.studies.error_diffusion import run_error_diffusion

    r = run_error_diffusion(tmp_path, arms=(f"latent_{levels}", f"ed_{levels}_k{k}"))
    ed = r["arms"][f"ed_{levels}_k{k}"]
    # The codes move: with them frozen (no gradient to the codes) the scales, embeddings and
    # norms alone still beat the latent baseline (ternary 0.054 against 0.717, measured).
    assert ed["flip_rate_mean"] > 0, ed
    assert ed["bits_per_weight"] <= 9.0
    assert r["arms"][f"latent_{levels}"]["bits_per_weight"] == 96.0
    assert ed["within_10pct"], ed
