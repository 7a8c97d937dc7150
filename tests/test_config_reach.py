"""Validation that reaches: every config key, at a valid non-default value, runs.

`test_config.py` walks every key with a bad value and checks it is refused
before anything is written. This file walks the other side: a value that
validates must also run, through the warm-start, the first GRPO step and the
checkpoint of that step (`loss.kl_beta=0.01` once validated, ran the whole
warm-start and failed at the first GRPO step).

The non-default values are grouped into a few short runs of the tiny model
(`RUNS`, each on top of `BASE`: 2 warm-start steps and 2 GRPO steps, a
checkpoint at the first GRPO step, step 3, and at the end). The coverage is
derived from `dataclasses.fields(TrainConfig)`: every key must take a value
other than the default config's in some run, and every choice of a `Literal`
key must appear in some run, or the key (or choice) is in `NOT_RUN` with the
reason it cannot run here. A new key with neither fails
`test_every_key_runs_at_a_non_default_value_or_says_why_not`.
"""

import dataclasses
import json
import math
import os
import string
import subprocess
import sys
import typing

import jax
import pytest
from helpers import TINY_MODEL

from jaxrl_lp.train import TrainConfig, apply_overrides, default_config

# 2 warm-start and 2 GRPO steps; step 3 (the first GRPO step) and step 4 are checkpointed.
SFT_STEPS, GRPO_STEPS = 2, 2
BASE = [*TINY_MODEL, f"sft.steps={SFT_STEPS}", "sft.batch_size=16", f"grpo.steps={GRPO_STEPS}",
        "grpo.prompts_per_step=4", "grpo.group_size=2", "run.eval_every=1", "run.eval_size=8",
        f"run.checkpoint_every={SFT_STEPS + 1}", "run.progress=false"]

# Stand-ins filled in by the test: a tiny Hugging Face checkpoint with a character
# tokenizer (`_hf_checkpoint`), a GSM8K-format file of a few records, and a user's
# directory (on the run's PYTHONPATH) with a JSONL of sums, its held-out file and an
# environment module.
HF, GSM8K, USER = "{hf}", "{gsm8k}", "{user}"

# The runs: each a list of overrides on top of BASE (a later value of a key wins).
RUNS = {
    # The dense family with every architecture switch, a one-digit subtraction task, the
    # dense learner log-probs, sequence-level ratios with both clips.
    "qwen3": [
        "model.family=qwen3", "model.loop_steps=1", "model.rope_theta=500000.0",
        "model.rms_eps=1e-5", "model.tie_embeddings=true", "model.qk_norm=true",
        "model.attention_bias=true", "model.head_dim=8", "model.max_position_embeddings=96",
        "model.init_std=0.05",
        # The task's tokenizer sets these four (`validate.model_config`): any value runs.
        "model.vocab_size=300", "model.bos_token_id=1", "model.eos_token_id=2",
        "model.pad_token_id=0",
        "task.ops=+-", "task.max_digits=1", "task.reverse_answer=false",
        "task.pad_operands=false", "task.seed=1",
        "sft.lr=1e-2", "sft.warmup_steps=0",
        "grpo.advantage=drgrpo", "grpo.logprobs=dense", "grpo.max_new_tokens=6",
        "loss.aggregation=seq_mean_token_sum_norm", "loss.ratio_level=sequence",
        "loss.epsilon=0.1", "loss.epsilon_high=0.3", "loss.dual_clip=3.0",
        "loss.correction=tis", "loss.correction_cap=3.0",
        "run.seed=1", "run.keep_checkpoints=3",
    ],
    # A deeper loop, a fixed exit, the deferred compute mode, inverse-CDF draws; a KL term
    # (k1) to the GRPO start; the ratio anchored on the learner; every batch replayed and
    # verified.
    "looped": [
        "model.loop_steps=3", "model.exit_rule=fixed:2", "grpo.exit_rule=fixed:3",
        "grpo.compute_mode=deferred", "grpo.draw=inverse_cdf", "grpo.advantage=rloo",
        "grpo.temperature=0.7",
        "grpo.lr=1e-3", "grpo.replay=always", "grpo.verify_every=1",
        "loss.kl_beta=0.01", "loss.kl_estimator=k1", "loss.ratio_anchor=learner",
        "loss.aggregation=seq_mean_token_mean", "loss.correction=mis",
    ],
    # Fair Cast: bf16 error-feedback export, the loss on the served copy, every sync check
    # each step; an unmatched learner (bf16) and sampler (f32); a k2 KL term.
    "fair_cast": [
        "sync.exporter=bf16:error_feedback", "sync.loss_on_served=true", "sync.check_every=1",
        "sync.seed=1", "grpo.learner_policy=bf16", "loss.kl_beta=0.05",
        "loss.kl_estimator=k2", "loss.correction=seq_tis",
    ],
    # The warm-start's end rounded to bf16 before GRPO, bf16 sampling.
    "bf16_start": [
        "sync.exporter=bf16:nearest", "sync.bf16_start=true", "grpo.sampler_policy=bf16",
        "grpo.learner_policy=bf16", "loss.correction=seq_mis",
    ],
    # Low-bit training: binary codes with error diffusion from the warm-start on; no start
    # probe.
    "low_bit": ["sft.optimizer=error_diffusion:binary:k=4", "sync.exporter=fmt:binary",
                "grpo.start_probe=false"],
    # Dynamic sampling with overlong shaping, mu=2 passes over 2 minibatches of 2 micro-
    # batches, recomputing the attention in the backward (`grpo.remat=dots`); no save on a
    # signal.
    "dynamic": [
        "grpo.dynamic_sampling=true", "grpo.max_refill_rounds=1", "grpo.max_new_tokens=6",
        "grpo.overlong_buffer=2", "grpo.overlong_penalty=0.5", "grpo.mu=2",
        "grpo.minibatches=2", "grpo.micro_batches=2", "grpo.remat=dots",
        "grpo.max_nonfinite_in_row=2", "run.save_on_signal=false",
        "distributed.timeout_s=60",
    ],
    # LoRA GRPO on the warm-start held as NVFP4 codes (QLoRA-style), three targets, served
    # merged (re-quantized to NVFP4) with the loss on that copy, every sync check each step.
    "lora": [
        "lora.rank=4", "lora.alpha=8.0", "lora.targets=q,v,down", "lora.base_format=nvfp4",
        "lora.serve=merged", "sync.loss_on_served=true", "sync.check_every=1",
        "grpo.verify_every=1",
    ],
    # A dense model whose first update of each step reads the sampler's weight products, in
    # two micro-batches; the second minibatch computes its forward.
    "products": ["model.family=qwen3", "model.loop_steps=1", "grpo.reuse_products=true",
                 "grpo.minibatches=2", "grpo.micro_batches=2"],
    # Speculative rollouts, self-drafted at one loop step, in two minibatches (the start
    # probe replays their 4-row slices by the speculative sampler's program), verified.
    "speculative": ["grpo.speculative=self:loops=1,k=2", "grpo.minibatches=2",
                    "grpo.verify_every=1"],
    # Sharded over the 8 CPU devices the tests have (conftest's XLA_FLAGS), its layers recomputed
    # in the backward (as the scale configs run).
    "mesh": ["run.mesh=fsdp=8", "grpo.prompts_per_step=8", "grpo.remat=layers"],
    # Off-policy: the sampler two versions behind, on 2 replicas of its own beside a learner
    # sharded over 2 devices.
    "offpolicy": ["grpo.max_staleness=2", "run.learner_mesh=fsdp=2", "run.sampler_mesh=data=2"],
    # Multi-turn episodes with a calculator tool (`envs.CalculatorTask`), every rollout
    # replayed and verified, advantages by turn.
    "calculator": [
        "task.kind=calculator", "task.max_digits=2", "task.second_digits=1",
        "task.max_turns=2", "task.tool_fraction=0.5", "task.env_timeout_s=5.0",
        "task.failure_reward=-0.5", "model.max_position_embeddings=64", "grpo.verify_every=1",
        "grpo.turn_credit=reward_to_go", "grpo.turn_discount=0.9",
    ],
    # GSM8K-format data with a Python-expression calculator (`envs.PythonCalculatorTask`).
    "gsm8k_tools": [
        "task.kind=gsm8k_tools", f"task.path={GSM8K}", f"init_from={HF}", "task.max_turns=2",
        "grpo.max_new_tokens=8", "grpo.verify_every=1",
    ],
    # GSM8K-format data with the tokenizer and weights of a Hugging Face checkpoint, which
    # is also the KL reference.
    "gsm8k": [
        "task.kind=gsm8k", f"task.path={GSM8K}", f"init_from={HF}", f"loss.reference={HF}",
        "loss.kl_beta=0.01", "grpo.max_new_tokens=8",
    ],
    # A user's JSONL with its own column names, a held-out file, two built-in reward
    # functions (one a format regex) and a system prompt in the plain format; logged to W&B
    # offline; the GPU flag preset (nothing off a GPU).
    "dataset": [
        "task.kind=dataset", f"task.path={USER}/sums.jsonl", "task.prompt_key=q",
        "task.answer_key=a", "task.completion_key=a", f"task.heldout={USER}/heldout.jsonl",
        "task.heldout_fraction=0.2", "task.rewards=exact_match,regex_format=0.1",
        "task.format_regex=[0-9]+", "task.reward_timeout_s=5.0", "task.system_prompt=Add.",
        "task.chat_template=none", "task.template_options=enable_thinking=false",
        "grpo.max_new_tokens=4", "run.wandb=true", "run.wandb_mode=offline",
        "run.wandb_project=reach", "run.xla_gpu_flags=decode_graphs,scheduler",
    ],
    # The same records as episodes of an environment of the user's own (`task.env`), turns
    # ending on '?' or at 3 tokens, observations cut to 4.
    "dataset_env": [
        "task.kind=dataset", f"task.path={USER}/sums.jsonl", "task.prompt_key=q",
        "task.answer_key=a", "task.env=reach_env:make_env", "task.stop=?", "task.max_turns=2",
        "task.max_turn_tokens=3", "task.max_observation_tokens=4", "grpo.verify_every=1",
    ],
    # Every update's value the learner's own parallel forward in the batch-invariant forms
    # (two minibatches: the second at moved weights), verified each step.
    "invariant": ["grpo.logprobs=invariant", "grpo.minibatches=2", "grpo.verify_every=1"],
    # The same with every product in fixed tiles (`kernels.fixed_tile`, its TPU version
    # interpreted: the GPU's form, checked here).
    "invariant_tiles": ["grpo.logprobs=invariant", "grpo.invariant_tiles=interpret-tpu",
                        "grpo.verify_every=1"],
    # `auto` with a KL reference, four minibatches and every step verified: the hybrid would
    # replay the decode 5 times a step (above the threshold of its 8 rows on any CPU's
    # column tile up to 128), so the run takes `invariant`.
    "logprobs_auto": ["grpo.logprobs=auto", "loss.kl_beta=0.05", "grpo.minibatches=4",
                      "grpo.verify_every=1"],
}

# Keys (or `key=choice` of a Literal key) no run here can take, and why.
NOT_RUN = {
    "distributed.coordinator": "several processes: tests/test_multiprocess.py",
    "distributed.num_processes": "several processes: tests/test_multiprocess.py",
    "distributed.process_id": "several processes: tests/test_multiprocess.py",
    "task.tools": "a chat checkpoint whose tokenizer has </tool_call> as one token: "
                  "tests/test_own_task_chat.py",
    "grpo.invariant_tiles=compiled": "the kernels compile for a GPU or TPU (refused on this "
                                     "CPU: tests/test_config.py); its programs lower here "
                                     "(tests/test_fixed_tile.py), a GPU runs them "
                                     "(benchmarks/gpu.sh SUITE=invariant)",
}


def _keys(cls: type, prefix: str = "") -> dict[str, typing.Any]:
    """Every config key of `cls` and its type hint, from the dataclass fields."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_keys(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = hints[f.name]
    return out


def _get(cfg, key: str):
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return cfg


def _overrides(name: str, out_dir, hf="/hf", gsm8k="/gsm8k.jsonl", user="/user") -> list[str]:
    return [o.replace(HF, str(hf)).replace(GSM8K, str(gsm8k)).replace(USER, str(user))
            for o in [*BASE, *RUNS[name], f"run.out_dir={out_dir}"]]


def test_every_key_runs_at_a_non_default_value_or_says_why_not():
    default = default_config()
    keys = _keys(TrainConfig)
    # Config values only (`__post_init__`); the paths are checked by `validate`, at run time.
    cfgs = {n: apply_overrides(default, _overrides(n, "/tmp/reach")) for n in RUNS}
    changed = {k for k in keys for c in cfgs.values() if _get(c, k) != _get(default, k)}
    choices = {f"{k}={v}" for k, hint in keys.items() if typing.get_origin(hint) is typing.Literal
               for v in typing.get_args(hint) if v != _get(default, k)}
    taken = {f"{k}={_get(c, k)}" for k in keys for c in cfgs.values()}
    missing = sorted((set(keys) - changed - set(NOT_RUN)) | (choices - taken - set(NOT_RUN)))
    assert not missing, (f"no run in RUNS takes these keys (or choices) at a non-default value, "
                         f"and NOT_RUN gives no reason: {missing}")
    stale = sorted(k for k in NOT_RUN if k in changed or k in taken)
    assert not stale, f"NOT_RUN lists keys a run does take: {stale}"


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny random Hugging Face checkpoint with a character tokenizer, and GSM8K records."""
    from jaxrl_lp.models.hf_io import save_hf_checkpoint
    from jaxrl_lp.models.model import init_params
    from jaxrl_lp.models.tokenizer import CharTokenizer

    root = tmp_path_factory.mktemp("reach")
    hf = root / "hf"
    tok = CharTokenizer(alphabet=string.ascii_letters + string.digits + " #.,?:\n+-=<>/*")
    tok.save(hf)
    records = [{"question": f"What is {a} + {b}?",
                "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}. #### {a + b}"}
               for a in range(1, 5) for b in range(1, 5)]
    gsm8k = root / "gsm8k.jsonl"
    gsm8k.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = apply_overrides(default_config(), [*TINY_MODEL, "model.max_position_embeddings=128"])
    mcfg = cfg.model.replace(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                             eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    save_hf_checkpoint(hf, mcfg, init_params(mcfg, jax.random.PRNGKey(5)))
    user = root / "user"
    user.mkdir()
    for name, pairs in (("sums", [(a, b) for a in range(6) for b in range(6)]),
                        ("heldout", [(a, b) for a in range(6, 9) for b in range(3)])):
        (user / f"{name}.jsonl").write_text("".join(
            json.dumps({"q": f"{a}+{b}=", "a": str(a + b)}) + "\n" for a, b in pairs))
    (user / "reach_env.py").write_text(ENV_MODULE)
    return hf, gsm8k, user


# `task.env`'s module: asks once for a guess ('?' ends the turn), then ends the episode.
ENV_MODULE = '''
from jaxrl_lp.envs import StepResult


class Ask:
    def __init__(self):
        self.turns = 0

    def step(self, turn):
        self.turns += 1
        if self.turns == 1 and turn.ended_by != "eos":
            return StepResult(observation="=")
        return StepResult(reward=float(turn.text.strip().endswith("?")), done=True)


def make_env():
    return Ask()
'''


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_key_at_a_non_default_value_runs_to_its_first_grpo_checkpoint(
        name, hf_checkpoint, tmp_path):
    hf, gsm8k, user = hf_checkpoint
    out = tmp_path / "run"
    args = [a for o in _overrides(name, out, hf, gsm8k, user) for a in ("--set", o)]
    # A process of its own per run (as `jaxrl-lp train` is run); it inherits the tests'
    # 8 CPU devices and compilation cache; the user's directory is on its PYTHONPATH.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(user), os.environ.get("PYTHONPATH", "")) if p)}
    res = subprocess.run([sys.executable, "-m", "jaxrl_lp.cli.main", "train", *args],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    first = SFT_STEPS + 1
    steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert first in steps and steps[-1] == SFT_STEPS + GRPO_STEPS, steps
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in records if r["phase"] == "grpo"]
    assert [r["step"] for r in grpo] == list(range(first, first + GRPO_STEPS))
    assert all(math.isfinite(r["loss"]) and r["skipped"] == 0.0 for r in grpo), grpo
    if name == "products":  # an update on the sampler's weights reads its products, others
        # replay (the second minibatch too, where the first moved nothing: no reward yet)
        assert all(r["reused_forward_updates"] >= 1.0 and r["reused_forward_updates"]
                   + r["replayed_updates"] == 2.0 for r in grpo), grpo
    if name == "logprobs_auto":  # resolved once, said once, recorded; no update replays
        assert "grpo.logprobs=auto: invariant (" in res.stderr, res.stderr[-3000:]
        assert json.loads((out / "config.json").read_text())["grpo"]["logprobs"] == "invariant"
        assert all(r["replayed_updates"] == 0.0 for r in grpo), grpo
    assert json.loads((out / "summary.json").read_text())["steps"] == SFT_STEPS + GRPO_STEPS
