"""KL to a frozen reference in the training program (`loss.kl_beta`, `loss.reference`).

The reference is the GRPO phase's starting weights (written once to
`<run_dir>/reference`) or a Hugging Face checkpoint; its log-probs come once
per batch from the behaviour log-prob program, so the first update's KL is 0
exactly; a run resumed inside GRPO reads the reference back and continues
bit for bit; with beta 0 nothing of it exists.
"""

import json

import jax
import numpy as np
import pytest
from helpers import LEARNS, latest_checkpoint, short_run

from jaxrl_lp.models.hf_io import save_hf_checkpoint
from jaxrl_lp.models.model import init_params
from jaxrl_lp.train import apply_overrides, default_config, run_train
from jaxrl_lp.train.logger import without_wall_clock
from jaxrl_lp.train.validate import build_task, model_config

KL = ["loss.kl_beta=0.05", "grpo.lr=1e-3"]


def _cfg(out, *extra):
    return apply_overrides(default_config(), [
        *short_run(sft_steps=4, grpo_steps=4, checkpoint_every=100), f"run.out_dir={out}",
        *extra])


def _records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_kl_beta_trains_logs_the_kl_from_zero_and_resumes_bit_for_bit(tmp_path):
    import shutil

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    # One warm-start for both runs: trained to its last step, then copied.
    run_train(_cfg(whole, *LEARNS, *KL), stop_after=300)
    shutil.copytree(whole, cut)
    summary = run_train(_cfg(whole, *LEARNS, *KL))
    assert (whole / "reference" / "300").is_dir()  # written once, at the first GRPO step
    grpo = [r for r in _records(whole) if r["phase"] == "grpo"]
    assert len(grpo) == 4
    # The reference is the starting weights and their log-probs the same program's: the
    # first update's KL is exactly 0, then the policy moves away from it.
    assert grpo[0]["kl_ref"] == 0.0 and grpo[0]["kl_loss"] == 0.0
    assert all(r["kl_ref"] > 0.0 for r in grpo[1:])
    assert all(r["timing_s/reference"] > 0.0 for r in grpo)
    # Killed inside GRPO (after GRPO step 2) and resumed: the reference is read back.
    assert run_train(_cfg(cut, *LEARNS, *KL), stop_after=302)["interrupted"]
    resumed = run_train(_cfg(cut, *LEARNS, *KL))
    assert resumed["final_accuracy"] == summary["final_accuracy"]
    assert [without_wall_clock(r) for r in _records(cut)] == \
        [without_wall_clock(r) for r in _records(whole)]
    jax.tree.map(np.testing.assert_array_equal, latest_checkpoint(cut)[1],
                 latest_checkpoint(whole)[1])


def test_beta_zero_builds_no_reference_and_a_beta_builds_one(finished_runs):
    # `plain` runs at beta 0; `fair` at helpers.GRPO_MOVES's beta 0.05.
    plain, fair = finished_runs["plain"][0], finished_runs["fair"][0]
    assert not (plain / "reference").exists()
    grpo = [r for r in _records(plain) if r["phase"] == "grpo"]
    assert grpo and not any("kl_ref" in r or "timing_s/reference" in r for r in grpo)
    assert (fair / "reference").is_dir()
    grpo = [r for r in _records(fair) if r["phase"] == "grpo"]
    assert grpo and all("kl_ref" in r and "timing_s/reference" in r for r in grpo)


def _checkpoint(path, cfg, **changes):
    mcfg = model_config(cfg, build_task(cfg)).replace(**changes)
    save_hf_checkpoint(path, mcfg, init_params(mcfg, jax.random.PRNGKey(9)))
    return path


def test_a_reference_checkpoint_is_used_and_bad_ones_are_refused(tmp_path):
    probe = _cfg(tmp_path / "probe")
    good = _checkpoint(tmp_path / "ref_good", probe)
    out = tmp_path / "with_ref"
    run_train(_cfg(out, *KL, f"loss.reference={good}", "grpo.steps=1"))
    assert not (out / "reference").exists()  # nothing written for a given reference
    grpo = [r for r in _records(out) if r["phase"] == "grpo"]
    assert grpo[0]["kl_ref"] > 0.0  # another model's log-probs
    vocab = _checkpoint(tmp_path / "ref_vocab", probe,
                        vocab_size=model_config(probe, build_task(probe)).vocab_size + 8)
    arch = _checkpoint(tmp_path / "ref_arch", probe, intermediate_size=96)
    for ref, message in (
            (tmp_path / "missing", "loss.reference=.* is not a directory"),
            (vocab, "loss.reference=.* vocabulary of .* ids and the model trained"),
            (arch, r"loss.reference=.* another architecture .*intermediate_size")):
        bad = tmp_path / f"bad_{ref.name}"
        with pytest.raises(ValueError, match=message):
            run_train(_cfg(bad, *KL, f"loss.reference={ref}"))
        assert not bad.exists()  # refused before anything was written
    with pytest.raises(ValueError, match="kl_beta is 0, so it would be ignored"):
        _cfg(tmp_path / "x", f"loss.reference={good}")
