"""The numerics studies: rounding-location alignment and backward state.

The design: docs/design/studies.md, "Numerics studies".

Fast versions at the quick size: the alignment measurement on random weights
(no training), one CLI run of each study with a few arms, and the errors for
unknown arm names.
"""

import json

import jax
import numpy as np
import pytest

from jaxrl_lp.cli.main import main as cli_main
from jaxrl_lp.numerics.policy import ALL_REGIONS, Policy
from jaxrl_lp.studies import alignment, backward_state
from jaxrl_lp.studies.common import QUICK_OVERRIDES, make_config


@pytest.fixture(scope="module")
def quick_model(tmp_path_factory):
    """The quick model at random weights (norm scales spread around 1), its task, a loop spec."""
    from jaxrl_lp.rollout.step import LoopSpec
    from jaxrl_lp.train.program import initial_state

    out = tmp_path_factory.mktemp("quick")
    cfg = make_config([*QUICK_OVERRIDES, f"run.out_dir={out}"])
    plan, state, _ = initial_state(cfg)
    g = cfg.grpo
    loop = LoopSpec(g.exit_rule, g.compute_mode).resolve(plan.model)
    # RMSNorm scales start at exactly 1.0, where rounding before or after the scale is
    # the same (the `norm` region then changes nothing); trained scales are not 1.
    key = jax.random.PRNGKey(3)

    def spread(path, x):
        if "norm" not in jax.tree_util.keystr(path):
            return x
        return x * jax.random.uniform(jax.random.fold_in(key, x.size), x.shape, x.dtype, 0.5, 1.5)

    params = jax.tree_util.tree_map_with_path(spread, state.params)
    return cfg, plan, params, loop


def test_arm_policies():
    assert alignment.arm_policy("all") == Policy.parse("bf16")
    assert alignment.arm_policy("bf16-engine") == Policy.parse("bf16-engine")
    for r in ALL_REGIONS:
        p = alignment.arm_policy(f"no_{r}")
        assert p.f32_regions == frozenset(ALL_REGIONS) - {r}
        assert p.compute_dtype == Policy.parse("bf16").compute_dtype
    with pytest.raises(ValueError, match="arms are all,no_rope"):
        alignment.arm_policy("no_attention")
    assert str(backward_state.arm_policy("mxfp4", "fresh")).startswith("p=f32,c=f32,mm=mxfp4,bwd=fresh")
    with pytest.raises(ValueError, match="formats are none,fp8,mxfp8"):
        backward_state.arm_policy("int4", "reuse")


@pytest.mark.slow
def test_alignment_mismatch_per_region(quick_model):
    """Sampler == learner: exactly 0; each region left out (and all of them): > 0."""
    cfg, plan, params, loop = quick_model
    m = alignment.measure_mismatch(params, plan.model, plan.task, loop, alignment.ARMS,
                                   num_prompts=8, group_size=2, temperature=1.0,
                                   max_new_tokens=plan.max_new_tokens, seed=0,
                                   methods=("replay",))
    assert set(m) == set(alignment.ARMS)
    for arm, e in m.items():
        assert e["tokens"] > 0, arm
        r = e["replay"]
        if arm == "all":
            assert r["mismatch_max_abs_dlogp"] == 0.0
            assert r["mismatch_k1"] == 0.0 and r["mismatch_k3"] == 0.0
            assert r["mean_abs_dlogp"] == 0.0
        else:
            assert r["mismatch_max_abs_dlogp"] > 0.0, arm
            assert r["mean_abs_dlogp"] > 0.0, arm


@pytest.mark.slow
@pytest.mark.ci
def test_backward_state_cli_quick(tmp_path, capsys):
    """`study backward-state` end to end. No format: reuse and fresh gradients bit-equal and
    equal to f32; MX formats: different, biased, still pointing the same way."""
    out = tmp_path / "bs"
    rc = cli_main(["study", "backward-state", "--quick", "--out", str(out), "--arms",
                   "none,mxfp8,mxfp4", "--steps", "2", "--sft-steps", "1",
                   "--set", "run.eval_size=4"])
    assert rc == 0
    r = json.loads((out / "backward_state.json").read_text())
    assert json.loads(capsys.readouterr().out)["study"] == "backward-state"
    g = r["gradients"]
    assert g["none"]["bit_equal"] and g["none"]["rel_diff_reuse_fresh"] == 0.0
    for b in backward_state.BACKWARDS:
        # No quantization with f32 compute: the f32 gradient itself.
        assert g["none"][b]["rel_error"] == 0.0 and g["none"][b]["bias_rel"] == 0.0
    for fmt in ("mxfp8", "mxfp4"):
        assert not g[fmt]["bit_equal"], fmt
        assert g[fmt]["rel_diff_reuse_fresh"] > 0.0, fmt
        for b in backward_state.BACKWARDS:
            assert 0.0 < g[fmt][b]["rel_error"] < 1.0, (fmt, b)
            assert np.isfinite(g[fmt][b]["bias_rel"]) and g[fmt][b]["cosine"] > 0.5, (fmt, b)
    # Four bits are coarser than eight.
    assert g["mxfp4"]["reuse"]["rel_error"] > g["mxfp8"]["reuse"]["rel_error"]
    # The loss curves: f32, and each format's two backwards, 2 steps each.
    assert r["curves"]["none-reuse"]["same_as"] == "f32"
    for name in ("f32", "mxfp8-reuse", "mxfp8-fresh", "mxfp4-reuse", "mxfp4-fresh"):
        assert len(r["curves"][name]["series"]["loss"]) == 2, name
    for name in backward_state.OUTPUT_FILES:
        assert (out / name).stat().st_size > 0, name


def test_capture_gradient_passes_through():
    params = {"w": jax.numpy.arange(3.0)}
    opt = backward_state.capture_gradient()
    g = {"w": jax.numpy.array([1.0, -2.0, 0.5])}
    upd, st = opt.update(g, opt.init(params), params)
    assert np.array_equal(st.grad["w"], g["w"]) and np.array_equal(upd["w"], g["w"])


@pytest.mark.slow
@pytest.mark.ci
def test_alignment_cli_quick(tmp_path, capsys):
    out = tmp_path / "al"
    rc = cli_main(["study", "alignment", "--quick", "--out", str(out), "--arms", "all,no_norm",
                   "--steps", "1", "--sft-steps", "10", "--set", "run.eval_size=4"])
    assert rc == 0
    r = json.loads((out / "alignment.json").read_text())
    assert set(r["mismatch"]) == {"all", "no_norm"} == set(r["arms"])
    assert r["mismatch"]["all"]["replay"]["mismatch_max_abs_dlogp"] == 0.0
    assert r["mismatch"]["no_norm"]["replay"]["mismatch_max_abs_dlogp"] > 0.0
    # The training program measured the same: a matched sampler has no mismatch.
    assert r["arms"]["all"]["series"]["mismatch_max_abs_dlogp"] == [0.0]
    assert len(r["arms"]["no_norm"]["series"]["reward_mean"]) == 1
    for name in ("alignment_mismatch.png", "alignment_reward.png"):
        assert (out / name).stat().st_size > 0
    assert json.loads(capsys.readouterr().out)["study"] == "alignment"


def test_study_bad_arms(capsys, tmp_path):
    assert cli_main(["study", "alignment", "--arms", "all,no_attention",
                     "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no_rope" in err and "bf16-engine" in err
    assert cli_main(["study", "backward-state", "--arms", "mxfp8,int4",
                     "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mxfp4" in err and "nvfp4" in err
    # A policy the study sets per arm cannot be overridden (it would be replaced silently).
    assert cli_main(["study", "alignment", "--set", "grpo.sampler_policy=bf16-engine",
                     "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "grpo.sampler_policy" in err
    # Called directly, the study functions name the valid arms too, before writing anything.
    with pytest.raises(ValueError, match="arms are all,no_rope"):
        alignment.run_alignment(tmp_path / "c", arms=("no_attention",))
    with pytest.raises(ValueError, match="formats are none,fp8"):
        backward_state.run_backward_state(tmp_path / "d", arms=("int4",))
    assert not any((tmp_path / d).exists() for d in "abcde")
