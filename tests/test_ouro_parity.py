"""Ouro checkpoints read out where the reference Ouro code reads out (f32, 1e-5).

The fixtures in `tests/fixtures/ouro/` were written by the public Ouro modeling
code (torch 2.13, transformers 4.57; `make_fixtures.py` there says how to rerun
it): tiny random checkpoints with saturated exit gates, MHA and GQA, 2-4 loop
steps, each with the reference's logits under its default read-out (the
config's `early_exit_step`, else `early_exit_threshold`, 1.0 when absent), at
every fixed exit step, at several thresholds and the expected read-out, and its
gate logits and f32 cumulative exit probabilities.

XLA's and torch's sigmoids differ by a few ulp on some inputs, so a position
whose cumulative exit probability lies within a few ulp of the threshold can
exit one step apart in the two codes. Such knife-edge positions are counted and
may disagree (at most `MAX_KNIFE_EDGE` of them per read-out, and only where the
cumulative probability is within `KNIFE_ULPS` ulp of the threshold); every other
position must match at 1e-5.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxrl_lp.models import ExitSchedule, LoopSpec, forward, from_pretrained
from jaxrl_lp.models.hf_config import read_hf_config
from jaxrl_lp.models.hf_io import save_hf_checkpoint
from jaxrl_lp.models.loop import exit_rule_from_hf
from jaxrl_lp.numerics.policy import Policy

FIXTURES = Path(__file__).parent / "fixtures" / "ouro"
NAMES = sorted(p.parent.name for p in FIXTURES.glob("*/reference.npz"))
ATOL = 1e-5
KNIFE_ULPS = 4
MAX_KNIFE_EDGE = 2
# What each fixture's config.json says, as our exit rule.
EXPECTED_RULES = {
    "mha_r4_default": "threshold:1.0:1",
    "gqa_r4_threshold1": "threshold:1.0:1",
    "gqa_r3_threshold1": "threshold:1.0:1",
    "mha_r2_threshold1": "threshold:1.0:1",
    "gqa_r4_threshold05": "threshold:0.5:1",
    "mha_r3_step1": "fixed:2",
    "gqa_r4_step_out_of_range": "threshold:1.0:1",  # step 7 of 4 is ignored, as the reference does
    "gqa_r2_gates_low": "threshold:1.0:1",
}


@functools.cache
def fixture(name):
    model = from_pretrained(FIXTURES / name)
    ref = dict(np.load(FIXTURES / name / "reference.npz"))
    return model, ref


@functools.partial(jax.jit, static_argnames=("cfg", "loop", "readout"))
def _forward(params, tokens, readout_steps, *, cfg, loop, readout):
    schedule = None if readout_steps is None else ExitSchedule(readout_BxT=readout_steps)
    logits, _, out = forward(params, cfg, Policy.parse("fp32"), tokens, loop=loop, schedule=schedule,
                             readout=readout)
    return logits, out.exit_steps, out.exit_pdf


def ours(name, rule="model", readout="exit", readout_step=None):
    """Our (logits, exit steps, exit pdf) of the fixture's tokens under `rule` / `readout`.

    `readout_step` reads every position out at that step (one compiled program
    serves every step).
    """
    model, ref = fixture(name)
    tokens = jnp.asarray(ref["tokens"], jnp.int32)
    steps = None if readout_step is None else jnp.full(tokens.shape, readout_step, jnp.int32)
    return _forward(model.params(), tokens, steps, cfg=model.config, loop=LoopSpec(rule),
                    readout=readout)


def reference_exits(cum_BxTxR, threshold):
    """The reference's threshold rule on its own cumulative probabilities."""
    hit = cum_BxTxR >= threshold
    return np.where(hit.any(-1), hit.argmax(-1), cum_BxTxR.shape[-1] - 1)


def knife_edge(cum_BxTxR, threshold):
    """Positions where some step's cumulative probability is within KNIFE_ULPS ulp of threshold."""
    ulp = np.spacing(np.float32(threshold))
    return (np.abs(cum_BxTxR - np.float32(threshold)) <= KNIFE_ULPS * ulp).any(-1)


def assert_readout_matches(name, logits, exits, ref_logits, ref_exits, edge):
    logits, exits = np.asarray(logits), np.asarray(exits)
    differ = exits != ref_exits
    assert not (differ & ~edge).any(), (
        f"{name}: exit steps differ off the knife edge at {np.argwhere(differ & ~edge).tolist()}")
    assert differ.sum() <= MAX_KNIFE_EDGE, f"{name}: {differ.sum()} knife-edge flips"
    err = np.abs(logits - ref_logits).max(-1)
    assert err[~differ].max() <= ATOL, f"{name}: max |dlogit| {err[~differ].max():.3g}"
    return int(differ.sum())


def test_fixtures_exercise_saturated_gates():
    """The fixtures are the hard case: threshold 1.0 reached before the last step."""
    assert set(NAMES) == set(EXPECTED_RULES)
    manifest = json.loads((FIXTURES / "manifest.json").read_text())
    assert manifest["transformers"].startswith("4.57") and manifest["torch"].startswith("2.13")
    saturated = [n for n in NAMES if (fixture(n)[1]["exit_cumsum"][..., :-1] >= 1.0).any()]
    assert len(saturated) >= 5, saturated
    # There, reading out after the last step (what "full" does) is far from the reference.
    for n in saturated:
        _, ref = fixture(n)
        r = ref["exit_cumsum"].shape[-1]
        assert np.abs(ref["logits_default"] - ref[f"logits_step{r - 1}"]).max() > 1.0


@pytest.mark.parametrize("name", NAMES)
def test_config_exit_rule_is_the_reference_readout(name):
    assert read_hf_config(FIXTURES / name).exit_rule == EXPECTED_RULES[name]
    model, _ = fixture(name)
    assert model.config.exit_rule == EXPECTED_RULES[name]


@pytest.mark.parametrize("name", NAMES)
def test_default_readout_matches_reference(name):
    model, ref = fixture(name)
    logits, exits, pdf = ours(name)
    # The exit distribution itself, in the reference's order of operations.
    np.testing.assert_allclose(np.asarray(pdf), ref["exit_pdf"], atol=ATOL)
    rule = model.config.exit_rule
    if rule.startswith("threshold"):
        t = float(rule.split(":")[1])
        ref_exits, edge = reference_exits(ref["exit_cumsum"], t), knife_edge(ref["exit_cumsum"], t)
    else:
        ref_exits = np.full(exits.shape, int(rule.split(":")[1]) - 1)
        edge = np.zeros(exits.shape, bool)
    assert_readout_matches(name, logits, exits, ref["logits_default"], ref_exits, edge)
    # CausalLM.__call__ reads out the same way by default.
    np.testing.assert_array_equal(np.asarray(model(ref["tokens"])), np.asarray(logits))


@pytest.mark.parametrize("name", NAMES)
def test_every_fixed_step_and_expected_readout_match_reference(name):
    _, ref = fixture(name)
    r = ref["exit_cumsum"].shape[-1]
    for k in range(r):
        logits, _, _ = ours(name, "full", readout_step=k)
        np.testing.assert_allclose(np.asarray(logits), ref[f"logits_step{k}"], atol=ATOL)
    expected, _, _ = ours(name, readout="expected")
    np.testing.assert_allclose(np.asarray(expected), ref["logits_expected"], atol=ATOL)


# Four thresholds compile four programs per configuration: the default suite sweeps the
# configuration with knife-edge positions and a 3-step GQA one, the slow tier the rest (3 s each).
SWEEP_DEFAULT = ("mha_r4_default", "gqa_r3_threshold1")


@pytest.mark.parametrize("name", [
    n if n in SWEEP_DEFAULT else pytest.param(n, marks=pytest.mark.slow)
    for n in NAMES if "step" not in n])
def test_threshold_readouts_match_reference(name):
    _, ref = fixture(name)
    flips = 0
    for t in (0.3, 0.6, 0.9, 1.0):
        logits, exits, _ = ours(name, f"threshold:{t}")
        flips += assert_readout_matches(
            name, logits, exits, ref[f"logits_threshold{t}"],
            reference_exits(ref["exit_cumsum"], t), knife_edge(ref["exit_cumsum"], t))
    print(f"{name}: {flips} knife-edge flips over 4 thresholds x {exits.size} positions")


@pytest.mark.parametrize("name", ["mha_r4_default", "mha_r3_step1", "gqa_r4_threshold05"])
def test_saved_checkpoint_is_what_the_reference_wrote(name, tmp_path):
    """Saving writes the reference's tensors and exit rule, so it reads out the same again."""
    model, ref = fixture(name)
    save_hf_checkpoint(tmp_path, model.config, model.params(), dtype="bf16")
    want, got = load_file(FIXTURES / name / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(got[k].view(np.uint16), want[k].view(np.uint16), err_msg=k)
    saved = json.loads((tmp_path / "config.json").read_text())
    original = json.loads((FIXTURES / name / "config.json").read_text())
    for key in ("model_type", "total_ut_steps", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_size", "vocab_size", "rope_theta",
                "rms_norm_eps", "tie_word_embeddings"):
        assert saved[key] == original[key], key
    assert set(original["auto_map"].items()) <= set(saved["auto_map"].items())
    r = saved["total_ut_steps"]
    assert exit_rule_from_hf(saved, r) == exit_rule_from_hf(original, r) == model.config.exit_rule
    again = from_pretrained(tmp_path)
    np.testing.assert_array_equal(np.asarray(again(ref["tokens"])), np.asarray(model(ref["tokens"])))


def test_sample_command_reads_out_by_the_checkpoint_rule(tmp_path, capsys):
    """`jaxrl-lp sample` on an Ouro checkpoint decodes with its own read-out by default."""
    from jaxrl_lp.cli.main import main

    _, ref = fixture("mha_r4_default")
    prompt = ",".join(str(int(t)) for t in ref["tokens"][0])
    out = tmp_path / "ro.npz"
    assert main(["sample", "--checkpoint", str(FIXTURES / "mha_r4_default"), "--prompt-ids",
                 prompt, "--greedy", "--max-new-tokens", "2", "--eos-id", "-1",
                 "--out", str(out)]) == 0
    saved = np.load(out)
    assert str(saved["loop"]) == "threshold:1.0:1/dense"
    # The first token is the argmax of the reference's default read-out at the prompt's end.
    assert int(saved["completion_tokens"][0, 0]) == int(ref["logits_default"][0, -1].argmax())
