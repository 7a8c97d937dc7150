"""A user's own task learns through `jaxrl-lp train`, as a new user runs it (the slow tier).

In a temporary directory outside the repository the test writes what a user brings: a
JSONL of two-digit sums (`{"question": "07+45=", "solution": "25"}`: operands padded and
the answer written least significant digit first, the form the built-in arithmetic task
uses because a 2-layer model learns it in minutes) and a module of reward functions with
TRL's signature. It then runs the installed command in a fresh process, with `PYTHONPATH`
naming the user's directory:

    jaxrl-lp train --set task.kind=dataset --set task.path=sums.jsonl \\
        --set task.prompt_key=question --set task.answer_key=solution \\
        --set task.rewards=myrewards:correct

on the embedded default model and schedule (no checkpoint: a character tokenizer built
from the file, a warm-start on the file's answers, then GRPO). Held-out accuracy rises
over the GRPO steps, the function's mean is in the metrics and every verification is
exact. The figures of a run are in the closing note of issue 49 and docs/guide.md.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

REWARDS = '''
def correct(prompts, completions, solution, **kwargs):
    """1.0 where the completion is the reference solution."""
    return [1.0 if c.strip() == s else 0.0 for c, s in zip(completions, solution)]
'''


@pytest.mark.slow
def test_a_users_task_learns_through_the_command_line(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "myrewards.py").write_text(REWARDS)
    with open(user / "sums.jsonl", "w") as f:
        for a in range(100):
            for b in range(100):
                f.write(json.dumps({"question": f"{a:02d}+{b:02d}=",
                                    "solution": str(a + b)[::-1]}) + "\n")
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(user), "JAX_PLATFORMS": "cpu"}
    args = ["task.kind=dataset", f"task.path={user / 'sums.jsonl'}", "task.prompt_key=question",
            "task.answer_key=solution", "task.rewards=myrewards:correct", "grpo.verify_every=5",
            "run.progress=false", f"run.out_dir={run}"]
    cmd = [os.path.join(os.path.dirname(sys.executable), "jaxrl-lp"), "train"]  # as installed
    for a in args:
        cmd += ["--set", a]
    done = subprocess.run(cmd, cwd=user, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in records if r["phase"] == "grpo"]
    evals = [r["accuracy"] for r in records if r["phase"] == "eval"]
    print(json.dumps({"initial_accuracy": summary["initial_accuracy"],
                      "final_accuracy": summary["final_accuracy"], "evals": evals,
                      "reward/correct": [r["reward/correct"] for r in grpo][::10],
                      "wall_seconds": summary["wall_seconds"]}))
    assert summary["final_accuracy"] > summary["initial_accuracy"] + 0.02
    assert all("reward/correct" in r and r["reward_failed/correct"] == 0.0 for r in grpo)
    assert np.mean([r["reward/correct"] for r in grpo[-10:]]) > np.mean(
        [r["reward/correct"] for r in grpo[:10]])
    verified = [r for r in grpo if r["replay_verified"] == 1.0]
    assert len(verified) == len(grpo) // 5
    assert all(r["mismatch_max_abs_dlogp"] == 0.0 for r in verified)


# By hand (`pytest -m slow`): about 7 minutes on 2 shared cores, and the
# default suite trains the same chat path exactly (tests/test_own_task_chat.py) and the test
# above learns through the same command.
@pytest.mark.slow
def test_a_users_task_learns_from_a_chat_checkpoint(tmp_path):
    """The same file and reward module through a checkpoint of the default model's shape
    (random weights, Hugging Face layout) whose tokenizer carries the Qwen3 chat template:
    the prompts are the template's rendering, the completions end with its `<|im_end|>`."""
    import jax
    from chat_helpers import make_chat_checkpoint_tokenizer

    from jaxrl_lp.models import init_params
    from jaxrl_lp.models.hf_io import save_hf_checkpoint
    from jaxrl_lp.models.tokenizer import HFTokenizer
    from jaxrl_lp.train import default_config

    user = tmp_path / "user"
    user.mkdir()
    (user / "myrewards.py").write_text(REWARDS)
    with open(user / "sums.jsonl", "w") as f:
        for a in range(100):
            for b in range(100):
                f.write(json.dumps({"question": f"{a:02d}+{b:02d}=",
                                    "solution": str(a + b)[::-1]}) + "\n")
    ckpt = user / "ckpt"
    make_chat_checkpoint_tokenizer(ckpt, "qwen3")
    tok = HFTokenizer.from_file(ckpt)
    mcfg = default_config().model.replace(vocab_size=tok.vocab_size, bos_token_id=None,
                                          eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    save_hf_checkpoint(ckpt, mcfg, init_params(mcfg, jax.random.PRNGKey(0)))
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(user), "JAX_PLATFORMS": "cpu"}
    args = ["task.kind=dataset", f"task.path={user / 'sums.jsonl'}", "task.prompt_key=question",
            "task.answer_key=solution", "task.rewards=myrewards:correct", f"init_from={ckpt}",
            "grpo.verify_every=5", "run.progress=false", f"run.out_dir={run}"]
    cmd = [os.path.join(os.path.dirname(sys.executable), "jaxrl-lp"), "train"]
    for a in args:
        cmd += ["--set", a]
    done = subprocess.run(cmd, cwd=user, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in records if r["phase"] == "grpo"]
    print(json.dumps({"initial_accuracy": summary["initial_accuracy"],
                      "final_accuracy": summary["final_accuracy"],
                      "evals": [r["accuracy"] for r in records if r["phase"] == "eval"],
                      "wall_seconds": summary["wall_seconds"]}))
    assert summary["final_accuracy"] > summary["initial_accuracy"] + 0.02
    verified = [r for r in grpo if r["replay_verified"] == 1.0]
    assert len(verified) == len(grpo) // 5
    assert all(r["mismatch_max_abs_dlogp"] == 0.0 for r in verified)
