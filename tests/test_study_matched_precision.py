"""`jaxrl-lp study matched-precision` end to end at a tiny size, and its arm definitions."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_lp.cli.main import main as cli_main
from jaxrl_lp.studies.matched_precision import ARMS, FORMATS, arm_overrides


def test_arm_overrides_name_the_policies_and_corrections():
    assert "grpo.sampler_policy=fp32" in arm_overrides("f32", 3)
    m = arm_overrides("nvfp4_matched", 3)
    assert {"grpo.learner_policy=nvfp4", "grpo.sampler_policy=nvfp4"} <= set(m)
    u = arm_overrides("mxfp4_unmatched_mis", 3)
    assert {"grpo.learner_policy=bf16", "grpo.sampler_policy=mxfp4", "loss.correction=mis",
            "loss.ratio_anchor=learner"} <= set(u)
    assert "loss.correction=none" in arm_overrides("fp8_unmatched", 3)
    assert len(ARMS) == 1 + 4 * len(FORMATS)
    with pytest.raises(ValueError, match="unknown arm 'fp6_matched'"):
        arm_overrides("fp6_matched", 3)


@pytest.mark.slow
@pytest.mark.ci
def test_matched_is_exact_and_unmatched_is_not(tmp_path):
    """Matched MXFP8 logs mismatch exactly 0 at every step; the unmatched arm does not."""
    out = tmp_path / "mp"
    arms = "mxfp8_matched,mxfp8_unmatched_tis"
    assert cli_main(["study", "matched-precision", "--quick", "--arms", arms, "--steps", "2",
                     "--sft-steps", "0", "--set", "run.eval_size=8", "--out", str(out)]) == 0
    r = json.loads((out / "matched_precision.json").read_text())
    series = json.loads((out / "matched_precision_series.json").read_text())
    m, u = r["arms"]["mxfp8_matched"], r["arms"]["mxfp8_unmatched_tis"]
    for key in ("mismatch_k1", "mismatch_k3", "mismatch_max_abs_dlogp"):
        assert series["mxfp8_matched"][key] == [0.0, 0.0], key
    assert m["mismatch_max_abs_dlogp"] == 0.0 and m["mismatch_k3_mean"] == 0.0
    assert u["mismatch_max_abs_dlogp"] > 1e-3 and u["mismatch_k3_mean"] > 0
    assert r["matched_below_unmatched"] == {"mxfp8": True}
    assert (u["learner_policy"], u["sampler_policy"], u["correction"]) == ("bf16", "mxfp8", "tis")
    for name in ("mismatch.png", "reward.png", "accuracy.png", "masked.png"):
        assert (out / name).stat().st_size > 0


def test_study_refuses_an_unknown_arm(capsys):
    assert cli_main(["study", "matched-precision", "--arms", "mxfp8_matched,fp6_matched"]) == 2
    assert "choose from f32," in capsys.readouterr().err


# The learner's gradient under MXFP8 against f32's, per weight leaf, from the same weights
# and tokens (tiny-qwen3, one layer): measured on XLA:CPU, cosine 0.995-0.999 and norm ratio
# 0.979-1.002; the bounds are ~4x and ~2x those gaps.
MX_GRAD_COSINE, MX_GRAD_NORM = 0.98, 0.05


def test_an_mxfp8_learners_gradient_is_f32s_up_to_the_format():
    """The fast version of the 60-step test below: a matched MXFP8 run learns as f32 does only
    if every weight's gradient through the quantized products is f32's up to the format's
    rounding. A product whose weight gets no gradient, or another one, fails here as there."""
    from jaxrl_lp.models.config import get_preset
    from jaxrl_lp.models.model import init_params
    from jaxrl_lp.numerics.policy import PRESETS
    from jaxrl_lp.rl.logprobs import learner_logprobs
    from jaxrl_lp.rollout import LoopSpec, Rollout

    cfg = get_preset("tiny-qwen3").replace(num_layers=1)
    params = init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    b, p, n = 4, 6, 10
    rows = dict(prompt_tokens=jnp.asarray(rng.integers(3, cfg.vocab_size, (b, p)), jnp.int32),
                prompt_lengths=jnp.full((b,), p, jnp.int32),
                completion_tokens=jnp.asarray(rng.integers(3, cfg.vocab_size, (b, n)), jnp.int32),
                completion_mask=jnp.ones((b, n)), logprobs=jnp.zeros((b, n)),
                exit_steps=jnp.zeros((b, n), jnp.int32), loop_evals=jnp.int32(0),
                weights_version=jnp.int32(0), loop=LoopSpec().resolve(cfg))
    w_BxN = jnp.asarray(rng.standard_normal((b, n)), jnp.float32)

    def grads(policy):
        ro = Rollout(**rows, policy=policy)
        f = lambda q: jnp.sum(learner_logprobs(q, cfg, policy, ro, "dense")[0] * w_BxN)
        return jax.jit(jax.grad(f))(params)

    f32, mx = grads(PRESETS["fp32"]), grads(PRESETS["mxfp8"])
    found = {}  # leaf: (cosine, norm ratio)
    for (path, a), c in zip(jax.tree_util.tree_flatten_with_path(f32)[0], jax.tree.leaves(mx),
                            strict=True):
        a, c = np.ravel(np.asarray(a, np.float64)), np.ravel(np.asarray(c, np.float64))
        found[jax.tree_util.keystr(path)] = (a @ c / (np.linalg.norm(a) * np.linalg.norm(c)),
                                             np.linalg.norm(c) / np.linalg.norm(a))
    print("MXFP8 vs f32 gradient, worst cosine and norm ratios:",
          min(x for x, _ in found.values()), min(r for _, r in found.values()),
          max(r for _, r in found.values()))
    bad = {k: v for k, v in found.items() if not (v[0] > MX_GRAD_COSINE and abs(v[1] - 1) < MX_GRAD_NORM)}
    assert not bad, bad


@pytest.mark.slow
def test_matched_mxfp8_grpo_improves_like_f32_with_zero_mismatch(tmp_path):
    """The default task and model, the default run's GRPO phase (60 steps, 32 x 8, 256
    held-out problems) from one f32 warm-start: matched MXFP8 gains within 12 points of
    the f32 arm's gain, with mismatch exactly 0 at every step. Measured (2-core CPU): at
    commit c711843 f32 44.5% -> 83.6%, MXFP8 41.4% -> 72.3%
    (docs/studies/matched-precision-mxfp8-60steps.json); at 079f3e7, whose warm-start
    reaches 87.5%, f32 87.5% -> 99.6% (+12.1), MXFP8 83.2% -> 99.6% (+16.4), 10 min under
    load. The f32 arm must gain 5 points (it once asked 20, more than that warm-start
    leaves). The fast version: `test_an_mxfp8_learners_gradient_is_f32s_up_to_the_format`."""
    from jaxrl_lp.studies.matched_precision import run_matched_precision

    r = run_matched_precision(tmp_path, arms=("f32", "mxfp8_matched"), steps=60,
                              overrides=("grpo.prompts_per_step=32", "run.eval_size=256"))
    f32, mx = r["arms"]["f32"], r["arms"]["mxfp8_matched"]
    assert f32["accuracy_gain"] > 0.05, f32
    assert mx["accuracy_gain"] >= f32["accuracy_gain"] - 0.12, (mx, f32)
    series = json.loads((tmp_path / "matched_precision_series.json").read_text())
    assert len(series["mxfp8_matched"]["mismatch_k1"]) == 60
    for key in ("mismatch_k1", "mismatch_k3", "mismatch_max_abs_dlogp"):
        assert set(series["mxfp8_matched"][key]) == {0.0}, key
